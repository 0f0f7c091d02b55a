"""Finding the primary among a multi-host DSN's hosts: every host tried at once, the first primary wins.

Only DSNs that name two or more hosts and ask for a primary (``target_session_attrs=read-write`` or
``primary``) are handled here; anything else goes to ``asyncpg.connect`` unchanged. Why, and what a standby
is asked every :data:`RETRY_INTERVAL`: ``docs/ha.md`` ("A hung primary").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import urllib.parse
from typing import Any

import asyncpg

__all__ = ["RETRY_INTERVAL", "connect_to_primary", "dsn_hosts"]

RETRY_INTERVAL = 0.25
"""Seconds between two attempts on a host that answered but cannot serve (a standby, refused, starting)."""

_PRIMARY = ("read-write", "primary")

# Worth asking again within the timeout: the host may become the primary (a standby being promoted, a
# server restarting, a route coming back). A TLS failure (an OSError too) or a wrong password will not fix
# itself.
_TRANSIENT = (asyncpg.TargetServerAttributeNotMatched, asyncpg.CannotConnectNowError, OSError)


def _transient(error: BaseException | None) -> bool:
    return isinstance(error, _TRANSIENT) and not isinstance(error, ssl.SSLError)


def dsn_hosts(dsn: str) -> list[tuple[str, int | None]]:
    """The ``(host, port)`` pairs a URI DSN names in its authority, in order (port None: the default).

    Follows asyncpg's parser: hosts separated by commas, IPv6 addresses in brackets, percent-decoded.
    Hosts given as a ``host=`` query parameter are not listed (asyncpg's own order then applies).
    """
    with contextlib.suppress(ValueError):
        hostlist = urllib.parse.urlsplit(dsn).netloc.rpartition("@")[2]
        found: list[tuple[str, int | None]] = []
        for spec in hostlist.split(","):
            if not spec:
                continue
            if spec.startswith("["):
                host, _, rest = spec[1:].partition("]")
                port = rest.removeprefix(":")
            else:
                host, _, port = spec.partition(":")
            port = urllib.parse.unquote(port)
            found.append((urllib.parse.unquote(host), int(port) if port.isdigit() else None))
        return found
    return []


def _wants_primary(dsn: str) -> bool:
    with contextlib.suppress(ValueError):
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(dsn).query))
        wanted = query.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS", "")
        return wanted in _PRIMARY
    return False


def _name(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


async def connect_to_primary(dsn: str, *, timeout: float, **kwargs: Any) -> asyncpg.Connection[Any]:
    """Connect to the primary among ``dsn``'s hosts, trying every host at once (asyncpg's ``connect``).

    The pool's ``connect`` callback: ``kwargs`` are what the pool passes on to ``asyncpg.connect``.

    Raises:
        TimeoutError: no host answered within ``timeout``.
        asyncpg.TargetServerAttributeNotMatched: no host was a primary within ``timeout``; the message
            says what each host did.
        Exception: a host's own error (a wrong password, a certificate not trusted) when no host was a
            primary and that error will not fix itself.
    """
    hosts = dsn_hosts(dsn)
    if len(hosts) < 2 or not _wants_primary(dsn):
        plain: asyncpg.Connection[Any] = await asyncpg.connect(dsn, timeout=timeout, **kwargs)
        return plain
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # What each host's last attempt ended with (None: none ended yet, e.g. a hung host), and whether it
    # failed. Once every host has failed at once (each refused, is a standby, or will not do), there is no
    # primary to wait for: give up as asyncpg would, and let the caller retry. While one host has not
    # answered, the others are asked again, so that a standby promoted meanwhile is found.
    last: list[BaseException | None] = [None] * len(hosts)
    failed = [False] * len(hosts)
    all_failed = asyncio.Event()
    # The first host to connect as a primary claims the win; a connection made after that, or after the
    # caller stopped waiting (cancelled, gave up), is dropped at once by the attempt that made it.
    won: list[asyncpg.Connection[Any]] = []
    over = False

    async def attempt(i: int, host: str, port: int | None) -> None:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                last[i] = TimeoutError()
                return
            failed[i] = False
            try:
                conn: asyncpg.Connection[Any] = await asyncpg.connect(
                    dsn, host=host, port=port, timeout=left, **kwargs
                )
            except Exception as exc:
                last[i] = exc
                failed[i] = True
                if all(failed):
                    all_failed.set()
                if not _transient(exc) or all(failed) or deadline - loop.time() <= RETRY_INTERVAL:
                    return
            else:
                if won or over:
                    conn.terminate()
                else:
                    won.append(conn)
                return
            await asyncio.sleep(RETRY_INTERVAL)

    tasks = [
        asyncio.create_task(attempt(i, host, port), name=f"connect {_name(host, port)}")
        for i, (host, port) in enumerate(hosts)
    ]
    gave_up = asyncio.create_task(all_failed.wait())
    try:
        pending: set[asyncio.Future[Any]] = {*tasks, gave_up}
        while not won and not all_failed.is_set() and pending - {gave_up}:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if won:
            return won[0]
        raise _no_primary(hosts, last, timeout)
    except BaseException:
        if won:  # won, but the caller was cancelled before it could take the connection
            won[0].terminate()
        raise
    finally:
        over = True
        # Not awaited: a cancelled attempt ends on its own (asyncpg closes what it had opened).
        gave_up.cancel()
        for task in tasks:
            task.cancel()


def _no_primary(
    hosts: list[tuple[str, int | None]], errors: list[BaseException | None], timeout: float
) -> BaseException:
    for error in errors:
        if error is not None and not _transient(error):
            return error  # a wrong password or certificate: say so, do not make it look like an outage
    if all(error is None or isinstance(error, TimeoutError) for error in errors):
        return TimeoutError()
    said = "; ".join(
        f"{_name(host, port)}: {_what(error, timeout)}"
        for (host, port), error in zip(hosts, errors, strict=True)
    )
    return asyncpg.TargetServerAttributeNotMatched(said)


def _what(error: BaseException | None, timeout: float) -> str:
    if error is None:
        return f"no answer within {timeout} s"
    if isinstance(error, asyncpg.TargetServerAttributeNotMatched):
        return "a standby"
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout} s"
    if isinstance(error, ConnectionRefusedError):
        return "refused"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
