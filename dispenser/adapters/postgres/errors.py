"""The driver's failures as this project's errors, with the DSN's password in no message and its hosts in no reply.

asyncpg's exceptions (and ``OSError``, which covers timeouts) become :class:`StoreUnavailable` (a data error:
:class:`StoreRefusedValue`) in one place, :func:`map_store_errors`; the DSN's password never appears in a
message, a ``repr`` or a log line, and where PostgreSQL is appears only in what is logged (``str(error)``).
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.parse
from collections.abc import Callable, Iterator, Sequence

import asyncpg

from dispenser.core.errors import DispenserError, StoreRefusedValue, StoreUnavailable

__all__ = ["dsn_secrets", "host_count", "invalid_settings", "map_store_errors", "misconfigured", "scrub"]

_REDACTED = "***"

_DATA_DETAIL = 200
"""Most characters of a data error's text kept in the message (asyncpg's quotes the value it refused)."""


def host_count(dsn: str) -> int:
    """How many hosts the DSN names (1 when it cannot be parsed)."""
    with contextlib.suppress(ValueError):
        netloc = urllib.parse.urlsplit(dsn).netloc.rpartition("@")[2]
        return max(1, len([h for h in netloc.split(",") if h]))
    return 1


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """The strings that must never appear in a message: the DSN's passwords, raw and percent-decoded.

    The split follows asyncpg's own parser (first ``@`` of the netloc, first ``:`` of the userinfo), so
    whatever asyncpg would send as the password is what gets hidden; ``sslpassword`` (the client key's
    passphrase) counts too.
    """
    secrets: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urllib.parse.urlsplit(dsn)
        auth, at, _ = parts.netloc.partition("@")
        if at and ":" in auth:
            raw = auth.partition(":")[2]
            secrets.update((raw, urllib.parse.unquote(raw)))
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if key in ("password", "sslpassword"):
                secrets.add(value)
    # An empty or one-character "password" would blank out half the message and protects nothing.
    return tuple(sorted((s for s in secrets if len(s) > 1), key=len, reverse=True))


def scrub(text: str, secrets: Sequence[str]) -> str:
    """Return ``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    return text


def invalid_settings(exc: ValueError, where: str, secrets: Sequence[str]) -> ValueError:
    """The error for a malformed DSN or option: a ``ValueError`` (no retry can help) without the password.

    asyncpg raises plain ``ValueError`` for some settings, and its text may quote the DSN.
    """
    return ValueError(scrub(f"invalid connection settings ({where}): {exc}", secrets))


def _describe(exc: BaseException, timeout: float | None, hosts: int = 1) -> str:
    if isinstance(exc, TimeoutError):
        if str(exc):
            return str(exc)
        return f"no answer within {timeout} s" if timeout is not None else "timed out"
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if hosts > 1 and isinstance(exc, (ConnectionRefusedError, asyncpg.TargetServerAttributeNotMatched)):
        # asyncpg reports the last host's error only, e.g. "connection refused" from a dead old primary
        # while the others answered as standbys: say what it means.
        return f"no primary among the DSN's {hosts} hosts (each is down or a standby; last error {detail})"
    if isinstance(exc, asyncpg.UndefinedTableError):
        detail += " (was the schema migrated? see dispenser.adapters.postgres.schema.migrate)"
    return detail


def _summary(exc: BaseException, timeout: float | None, hosts: int) -> str:
    """What failed, in words that name no host, port, user or database: the caller's part of the message."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout} s" if timeout is not None else "timed out"
    if hosts > 1 and isinstance(exc, (ConnectionRefusedError, asyncpg.TargetServerAttributeNotMatched)):
        return f"no primary among the DSN's {hosts} hosts (each is down or a standby)"
    if isinstance(exc, asyncpg.PostgresError) and exc.sqlstate:
        return f"{type(exc).__name__} (SQLSTATE {exc.sqlstate})"
    return type(exc).__name__


@contextlib.contextmanager
def map_store_errors(
    action: str,
    *,
    where: str,
    secrets: Sequence[str] = (),
    timeout: float | None = None,
    unavailable: Callable[..., DispenserError] = StoreUnavailable,
    hosts: int = 1,
) -> Iterator[None]:
    """Turn the driver's exceptions raised inside the block into :class:`StoreUnavailable` (or ``unavailable``).

    A data error (SQLSTATE class 22: a NUL in text, a value too long for its column) becomes
    :class:`StoreRefusedValue` instead: the server is up and refused the statement's values. Converted
    otherwise: every asyncpg error (server-side ``PostgresError``, client-side ``InterfaceError``, and
    ``InternalClientError``) and ``OSError`` (refused or reset connections, DNS failures, and
    ``TimeoutError``). Our own errors and cancellation pass through untouched.

    The error's ``message`` (what a caller is answered) says what failed and the driver's exception class,
    never where: the DSN's hosts, port, user and database and the driver's own words are in ``str(error)``
    only, for the worker's log and the operator (with the password masked there too).

    Args:
        action: what was being done, for the message ("fetching the next segment of 'order'").
        where: the redacted DSN (see :func:`dispenser.redaction.redact`).
        secrets: strings to blank out of the driver's message (see :func:`dsn_secrets`).
        timeout: the timeout in force, to say how long we waited when one fires.
        unavailable: the error to raise, built from the caller's message and ``logged=`` the full one
            (the worker registry raises ``CoordinatorUnavailable``).
        hosts: how many hosts the DSN names (a refused connection then means "no primary").
    """
    try:
        yield
    except asyncpg.DataError as exc:
        # SQLSTATE class 22 (and asyncpg's own "invalid input for query argument"): PostgreSQL answered and
        # refused a value. No outage, and no retry of the same values can succeed.
        detail = str(exc) if len(str(exc)) <= _DATA_DETAIL else str(exc)[:_DATA_DETAIL] + "…"
        raise StoreRefusedValue(action, exc.sqlstate, scrub(detail, secrets)) from exc
    except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError) as exc:
        hosts = max(hosts, host_count(where))
        public = f"{action}: {_summary(exc, timeout, hosts)}; details in the worker's log"
        raw = f"{action} ({where}): {_describe(exc, timeout, hosts)}"
        logged = scrub(raw, secrets)
        if logged == raw:
            raise unavailable(scrub(public, secrets), logged=logged) from exc
        # The driver's message carried the password: suppress the chain so that tracebacks and error
        # reporters (which honour __suppress_context__) never print the original.
        raise unavailable(scrub(public, secrets), logged=logged) from None


_MISCONFIGURED = (ssl.SSLCertVerificationError, asyncpg.InvalidAuthorizationSpecificationError)
"""Failures that are this worker's settings, not an outage: a certificate its CA does not verify, a wrong
password or a role the server refuses."""


def misconfigured(error: BaseException) -> bool:
    """Whether ``error`` came from :data:`_MISCONFIGURED`.

    A lazy start waits out an outage (no primary yet, a failover); waiting for a wrong CA or password
    to fix itself would hide the mistake behind a worker that never serves, so those still stop it.
    """
    cause = error.__cause__ or error.__context__
    while cause is not None:
        if isinstance(cause, _MISCONFIGURED):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
