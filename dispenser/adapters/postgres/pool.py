"""The asyncpg pool as the store needs it.

No reset query per release, a check on every new connection, and asyncpg's reconnect tracebacks quieted to
one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import asyncpg

from dispenser.adapters.postgres.errors import invalid_settings, map_store_errors
from dispenser.adapters.postgres.hosts import connect_to_primary

__all__ = ["CANCEL_GRACE", "Pooled", "lend", "open_pool"]

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

Pooled: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"
"""A connection lent by the pool (what ``pool.acquire()`` yields)."""


class _QuietPoolFloor(logging.Filter):
    """Turns asyncpg's pool tracebacks at WARNING into one line at DEBUG.

    The pool logs a full traceback each time it fails to reopen a connection in the background: during a
    failover, one every few seconds per pool, for an outage the allocator already reports in one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


log = logging.getLogger(__name__)

_pool_logger = logging.getLogger("asyncpg.pool")
if not any(isinstance(f, _QuietPoolFloor) for f in _pool_logger.filters):
    _pool_logger.addFilter(_QuietPoolFloor())


async def _keep_session(_conn: asyncpg.Connection[Any]) -> None:
    """Pool reset hook: nothing to undo, so skip asyncpg's default reset query.

    The default runs ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`` on every
    release: a second round trip per segment. This store never changes session state (no SET, LISTEN,
    cursors or session-level advisory locks), and asyncpg still rolls back a transaction left open.
    """


async def open_pool(
    dsn: str,
    *,
    where: str,
    secrets: Sequence[str],
    hosts: int,
    min_size: int,
    max_size: int,
    command_timeout: float,
    connect_timeout: float,
    application_name: str,
    init: Callable[[asyncpg.Connection[asyncpg.Record]], Coroutine[Any, Any, None]],
) -> asyncpg.Pool[asyncpg.Record]:
    """Open a pool to ``dsn`` whose every new connection is first checked by ``init``.

    Raises:
        StoreUnavailable: the first ``min_size`` connections could not be opened (or ``init`` refused one).
        ValueError: the DSN or an option is malformed (the message hides the password).
    """
    with map_store_errors("connecting", where=where, secrets=secrets, timeout=connect_timeout, hosts=hosts):
        try:
            pool: asyncpg.Pool[asyncpg.Record] = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                command_timeout=command_timeout,
                timeout=connect_timeout,
                reset=_keep_session,
                init=init,
                # Every host of a multi-host DSN at once, so a hung one cannot hide the primary (hosts.py).
                # (cast: the stubs want every keyword of asyncpg.connect spelled out; they are passed on.)
                connect=cast(Any, connect_to_primary),
                server_settings={"application_name": application_name},
            )
            return pool
        except ValueError as exc:
            if isinstance(exc, OSError):
                raise  # a TLS failure (e.g. certificate verify failed): unavailable, as at run time
            raise invalid_settings(exc, where, secrets) from None


CANCEL_GRACE = 0.25
"""Seconds a timed-out statement's connection waits for the server to confirm the cancellation."""


@contextlib.asynccontextmanager
async def lend(pool: asyncpg.Pool[asyncpg.Record], timeout: float | None) -> AsyncIterator[Pooled]:
    """A connection of ``pool`` for the block; dropped soon if the server stops answering meanwhile.

    A statement that timed out (``command_timeout``) leaves its connection busy until the server confirms
    the cancellation asyncpg sends; the release would wait for that up to the acquire ``timeout``, and a
    hung server never confirms. A live one does within milliseconds (and the statement then had no effect),
    so the wait is cut to :data:`CANCEL_GRACE`; past it the connection is terminated, and the pool's other
    connections, most likely to the same server, are replaced at their next use, so the next statement
    opens a connection to whichever host is the primary now rather than hanging on the same host again. A
    statement terminated unconfirmed may still complete on the server later: like any failed fetch, its
    range is never handed out (a gap).

    A block cancelled (a stop) terminates its connection at once: its statement, if one is in flight, is
    abandoned, and waiting for a silent server to confirm its cancellation would hold the stop for up to
    the acquire ``timeout``. Every release runs in a task of its own whose outcome is always retrieved:
    asyncpg shields its release from cancellation, and a release whose waiter was cancelled then failed
    with nobody to retrieve the error (asyncio's "Task exception was never retrieved", logged at ERROR).

    Raises:
        TimeoutError: no connection within ``timeout`` (asyncpg's acquire), or the statement timed out.
    """
    conn = await pool.acquire(timeout=timeout)
    try:
        yield conn
    except TimeoutError:
        try:
            await _release(pool, conn, CANCEL_GRACE)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError):
            # asyncpg terminated the connection when the wait ran out (and released it to the pool).
            await pool.expire_connections()
            raise TimeoutError(
                "no answer within postgres.command_timeout, nor to the cancellation; connection dropped"
            ) from None
        raise
    except OSError:  # the connection broke: the others may be as bad
        with contextlib.suppress(asyncpg.InterfaceError):  # already released to the pool
            conn.terminate()
        await pool.expire_connections()
        raise
    except asyncio.CancelledError:
        with contextlib.suppress(asyncpg.InterfaceError):  # already released to the pool
            conn.terminate()
        raise
    finally:
        await _release(pool, conn, None)  # does nothing if released above (or terminated)


async def _release(pool: asyncpg.Pool[asyncpg.Record], conn: Pooled, timeout: float | None) -> None:
    """``pool.release(conn)`` in a task that survives a cancellation of its waiter, its error always retrieved."""
    release = asyncio.ensure_future(pool.release(conn, timeout=timeout))
    release.add_done_callback(_retrieved)
    await asyncio.shield(release)


def _retrieved(release: asyncio.Future[None]) -> None:
    """Take a release's outcome, so that asyncio never logs it as an error nobody saw."""
    if not release.cancelled() and (exc := release.exception()) is not None:
        log.debug("a pooled connection's release failed (its connection is dropped): %r", exc)
