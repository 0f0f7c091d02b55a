"""The logger kazoo is given, with a filter that prints its requests by type and path only.

kazoo logs every request it sends at DEBUG, the digest credentials (``Auth``), the session password
(``Connect``) and ACLs included.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["KAZOO_LOG"]


def _summary(arg: Any) -> Any:
    """A kazoo request or response (a namedtuple of ``kazoo.*``, or a tuple or list of them) by type and path."""
    kind = type(arg)
    if isinstance(arg, tuple) and hasattr(kind, "_fields") and kind.__module__.startswith("kazoo."):
        path = getattr(arg, "path", None)
        return f"{kind.__name__}(path={path!r})" if path is not None else f"{kind.__name__}(…)"
    if kind in (tuple, list):  # a response such as (ACLs, stat): its parts
        return kind(_summary(a) for a in arg)
    return arg


class _Redact(logging.Filter):
    """Print kazoo's requests by type and path only.

    Its DEBUG line ``Sending request(xid=…): …`` shows whole requests: the digest credentials (``Auth``),
    the session password (``Connect``) and ACLs included.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            args = tuple(_summary(a) for a in record.args)
            if "session_passwd" in str(record.msg) and len(args) > 1:
                args = (args[0], "***", *args[2:])  # the session password lets anyone take the session over
            record.args = args
        return True


# The name it had before the session module was split (operators may configure it).
KAZOO_LOG = logging.getLogger("dispenser.adapters.zookeeper.session.kazoo")
"""The logger kazoo is given (not its own ``kazoo.client``), so that the filter sees every record it logs."""
KAZOO_LOG.addFilter(_Redact())
