"""The segment store's implementations, for every contract suite of it (segments, daily rows, returns)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.ports import SegmentStore
from dispenser.testing.fakes import MemorySegmentStore


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SegmentStore]:
    """Each implementation, empty: the fake, and the Postgres adapter on a fresh migrated database.

    A pool of 8: the suites run up to 8 fetches at once (one connection each).
    """
    if request.param == "memory":
        memory = MemorySegmentStore()
        yield memory
        await memory.close()
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    await migrate(dsn)
    postgres = await PostgresSegmentStore.connect(dsn, max_size=8)
    yield postgres
    await postgres.close()
