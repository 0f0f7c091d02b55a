"""Masking secrets in URLs and DSNs, for logs and error messages (importable by every layer)."""

from __future__ import annotations

import re

__all__ = ["redact"]

_SECRET_IN_URL = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@]*):(?P<pw>[^@/]*)@", re.I)
_SECRET_PARAM = re.compile(r"(password|sslpassword|token)=([^&\s]+)", re.I)
# In a NATS URL, user info without a colon is a token (nats://TOKEN@host), not a user name as in a DSN.
_TOKEN_IN_NATS_URL = re.compile(r"(?P<scheme>(?:nats|tls|ws|wss)://)[^:/@,\s]+@", re.I)


def redact(url_or_dsn: str) -> str:
    """Mask passwords and tokens in a URL or DSN, for logs and error messages."""
    masked = _SECRET_IN_URL.sub(r"\g<scheme>\g<user>:***@", url_or_dsn)
    masked = _TOKEN_IN_NATS_URL.sub(r"\g<scheme>***@", masked)
    return _SECRET_PARAM.sub(r"\1=***", masked)
