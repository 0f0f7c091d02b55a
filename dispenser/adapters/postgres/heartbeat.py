"""A connection used every second, so that a failover is noticed (and repaired) promptly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import asyncpg

from dispenser.adapters.postgres.pool import Pooled, lend
from dispenser.core.errors import DispenserError

__all__ = ["HEARTBEAT_INTERVAL", "beat"]

HEARTBEAT_INTERVAL = 1.0
"""Seconds between the connection checks of a store that remembers grants (see :func:`beat`)."""


async def beat(
    ready: Callable[[], Awaitable[asyncpg.Pool[asyncpg.Record]]],
    timeout: float | None,
    check: Callable[[Pooled], Awaitable[None]],
) -> None:
    """Run ``check`` on a connection of the pool ``ready`` returns every :data:`HEARTBEAT_INTERVAL` seconds.

    A worker whose buffers hold IDs may not fetch for minutes; its grants must still be restored on a
    new primary before the other workers fetch there. A new connection is checked by the pool itself;
    ``check`` (which primary this connection reaches now) covers a pooler that kept the socket across a
    failover. Errors are not reported here: the allocator
    reports outages, this only gets a new connection opened (and checked) as soon as one can be.
    """
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        with contextlib.suppress(
            DispenserError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            OSError,
        ):
            async with lend(await ready(), timeout) as conn:
                await check(conn)
