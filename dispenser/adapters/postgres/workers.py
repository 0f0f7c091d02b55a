"""Snowflake worker IDs from PostgreSQL (``postgres`` mode), for teams without ZooKeeper.

One row per worker address in ``dispenser_snowflake_worker`` (:data:`WORKER_TABLE_DDL`), created here on the
first :meth:`~PostgresWorkerRegistry.register`; the address keeps its worker ID for good. How an ID is
assigned, and why the database is a weak dependency once registered: ``docs/snowflake.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

import asyncpg

from dispenser.adapters.postgres.errors import dsn_secrets, invalid_settings, map_store_errors
from dispenser.adapters.postgres.hosts import connect_to_primary
from dispenser.core.errors import CoordinatorUnavailable, LeaseLost, WorkerIdOutOfRange, WorkerIdsExhausted
from dispenser.ports import WorkerLease
from dispenser.redaction import redact

__all__ = ["WORKER_TABLE_DDL", "PostgresWorkerRegistry"]

WORKER_TABLE_DDL: Final = """
CREATE TABLE IF NOT EXISTS dispenser_snowflake_worker (
    address       text        PRIMARY KEY,
    worker_id     int         UNIQUE NOT NULL CHECK (worker_id >= 0),
    high_water_ms bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz
)
"""
"""The worker table (one row per ``ip:port``); safe to run again."""

ALLOCATION_LOCK_KEY: Final = 0x6C65_6166_776B_6964
"""``pg_advisory_xact_lock`` key serialising worker-ID allocation (the bytes of ``leafwkid``)."""

# The smallest ID not in use: 0, or one past a used ID, whichever is free first. Both come from the unique
# index on worker_id, so this stays cheap however large the layout's worker field is.
_ALLOCATE = """
INSERT INTO dispenser_snowflake_worker (address, worker_id, high_water_ms, updated_at)
SELECT $1, candidate.id, 0, now()
  FROM (SELECT 0 AS id UNION SELECT worker_id + 1 FROM dispenser_snowflake_worker) AS candidate
 WHERE candidate.id <= $2
   AND NOT EXISTS (SELECT 1 FROM dispenser_snowflake_worker w WHERE w.worker_id = candidate.id)
 ORDER BY candidate.id
 LIMIT 1
ON CONFLICT (address) DO NOTHING
RETURNING worker_id, high_water_ms
"""

_FIND = "SELECT worker_id, high_water_ms FROM dispenser_snowflake_worker WHERE address = $1"

_REPORT = """
UPDATE dispenser_snowflake_worker
   SET high_water_ms = GREATEST(high_water_ms, $2), updated_at = now()
 WHERE address = $1 AND worker_id = $3
RETURNING high_water_ms
"""


class PostgresWorkerRegistry:
    """:class:`~dispenser.ports.WorkerRegistry` in ``postgres`` mode (see the module docstring).

    Opens one connection per call (registration and reports are seconds apart), so a restarted
    database needs no reconnect logic.

    Args:
        dsn: ``postgresql://user:password@host:port/database?sslmode=…`` (asyncpg's syntax).
        address: This worker's ``ip:port``; the same address gets the same worker ID back.
        max_worker_id: The layout's largest worker ID.
        connect_timeout: Seconds to open a connection.
        command_timeout: Seconds one statement may take.
    """

    mode = "postgres"

    def __init__(
        self,
        dsn: str,
        address: str,
        *,
        max_worker_id: int,
        connect_timeout: float = 5.0,
        command_timeout: float = 5.0,
    ) -> None:
        if max_worker_id < 0:
            raise ValueError(f"max_worker_id must be at least 0, got {max_worker_id}")
        if not address:
            raise ValueError("worker address must not be empty")
        self.address = address
        self.max_worker_id = max_worker_id
        self._dsn = dsn
        self._where = redact(dsn)
        self._secrets = dsn_secrets(dsn)
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._worker_id: int | None = None
        self._reported = 0
        self._lost: str | None = None

    def __repr__(self) -> str:
        return f"PostgresWorkerRegistry({self._where}, {self.address!r})"

    @property
    def worker_id(self) -> int | None:
        """The worker ID once registered."""
        return self._worker_id

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return map_store_errors(
            action, where=self._where, secrets=self._secrets, unavailable=CoordinatorUnavailable
        )

    async def _connect(self) -> asyncpg.Connection[Any]:
        try:
            return await connect_to_primary(
                self._dsn,
                timeout=self._connect_timeout,
                command_timeout=self._command_timeout,
                server_settings={"application_name": "leaf-dispenser worker registry"},
            )
        except ValueError as exc:
            if isinstance(exc, OSError):
                raise  # a TLS failure (ssl's errors are both): the registry is unavailable
            raise invalid_settings(exc, self._where, self._secrets) from None

    async def register(self) -> WorkerLease:
        """Find this address's row or give it the smallest unused worker ID.

        Raises:
            WorkerIdsExhausted: every ID from 0 to ``max_worker_id`` belongs to another address.
            WorkerIdOutOfRange: this address's row holds an ID over ``max_worker_id`` (the layout shrank).
            CoordinatorUnavailable: the database could not be reached or did not answer in time.
        """
        with self._errors("registering the worker"):
            conn = await self._connect()
            try:
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", ALLOCATION_LOCK_KEY)
                    # Under the lock: two first workers racing on CREATE TABLE IF NOT EXISTS can both
                    # miss the table and one then fails on the catalog's unique index.
                    await conn.execute(WORKER_TABLE_DDL)
                    row = await conn.fetchrow(_FIND, self.address)
                    if row is None:
                        row = await conn.fetchrow(_ALLOCATE, self.address, self.max_worker_id)
                    if row is None:
                        raise WorkerIdsExhausted(
                            self.max_worker_id + 1, f"{self._where} dispenser_snowflake_worker"
                        )
            finally:
                await _close(conn)
        worker_id, high_water = int(row["worker_id"]), int(row["high_water_ms"])
        if worker_id > self.max_worker_id:
            raise WorkerIdOutOfRange(worker_id, self.max_worker_id)
        self._worker_id = worker_id
        self._lost = None
        self._reported = max(self._reported, high_water)
        return WorkerLease(worker_id=worker_id, high_water_ms=high_water)

    async def report(self, high_water_ms: int) -> None:
        """Raise the row's ``high_water_ms`` to ``high_water_ms`` and stamp ``updated_at``.

        Raises:
            CoordinatorUnavailable: not registered yet, or the database did not answer in time (the worker
                keeps issuing; call again on the next tick).
            LeaseLost: the row is gone or now holds another ID (someone edited the table).
        """
        worker_id = self._worker_id
        if worker_id is None:
            raise CoordinatorUnavailable(
                "not registered (register() has not succeeded yet)",
                logged=f"{self}: not registered (register() has not succeeded yet)",  # the DSN: the log's
            )
        if self._lost is not None:
            raise LeaseLost(worker_id, self._lost)
        self._reported = max(self._reported, high_water_ms)
        with self._errors("reporting the high-water mark"):
            conn = await self._connect()
            try:
                row = await conn.fetchrow(_REPORT, self.address, self._reported, worker_id)
            finally:
                await _close(conn)
        if row is None:
            self._lost = f"its row for {self.address!r} in dispenser_snowflake_worker was removed or changed"
            raise LeaseLost(worker_id, self._lost)

    def can_issue(self) -> bool:
        """True once registered, also while the database is down: the ID is this address's for good."""
        return self._worker_id is not None and self._lost is None

    async def close(self) -> None:
        """Forget the registration (the row stays: the address keeps its ID for the next run)."""
        self._worker_id = None


async def _close(conn: asyncpg.Connection[Any]) -> None:
    try:
        await asyncio.wait_for(conn.close(), 2.0)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        conn.terminate()
