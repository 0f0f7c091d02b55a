"""The address-keyed WorkerRegistry contract, run against the in-memory fake, PostgreSQL and ZooKeeper.

What every registry that keys worker IDs by address (``postgres`` and Leaf's ``zookeeper`` mode) promises,
and what the fake used by fast tests must therefore do too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from dispenser.adapters.postgres.workers import PostgresWorkerRegistry
from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry
from dispenser.core.errors import WorkerIdsExhausted
from dispenser.ports import WorkerRegistry
from dispenser.testing.fakes import MemoryWorkerRegistry, MemoryWorkerTable
from dispenser_lab.servers.zookeeper import ZooKeeperServer

Factory = Callable[[str, int], WorkerRegistry]
"""``(address, max_worker_id)`` → a registry of one worker, all sharing one record."""

MARK = time.time_ns() // 1_000_000 + 600_000
"""A mark ahead of the clock (a reservation): Leaf's mode also stamps the node with the time it registers."""
_names = itertools.count()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("zookeeper", marks=pytest.mark.zookeeper),
    ]
)
async def registries(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """A factory of registries over one fresh record, closing every registry it made afterwards."""
    made: list[WorkerRegistry] = []
    if request.param == "memory":
        table = MemoryWorkerTable()

        def factory(address: str, max_worker_id: int) -> WorkerRegistry:
            made.append(MemoryWorkerRegistry(table, address, max_worker_id=max_worker_id))
            return made[-1]

    elif request.param == "postgres":
        dsn: str = request.getfixturevalue("pg_dsn")

        def factory(address: str, max_worker_id: int) -> WorkerRegistry:
            made.append(PostgresWorkerRegistry(dsn, address, max_worker_id=max_worker_id))
            return made[-1]

    else:
        server: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        name = f"contract-{next(_names)}"

        def factory(address: str, max_worker_id: int) -> WorkerRegistry:
            made.append(ZooKeeperRegistry(server.hosts, name, address, max_worker_id=max_worker_id))
            return made[-1]

    yield factory
    await asyncio.gather(*(registry.close() for registry in made), return_exceptions=True)


async def test_an_address_gets_its_id_and_highest_mark_back(registries: Factory) -> None:
    """Register, report (a lower report is ignored), close; the same address gets the same ID and mark."""
    first = registries("10.0.0.1:8080", 1023)
    lease = await first.register()
    assert lease.high_water_ms == 0
    assert first.can_issue()
    await first.report(MARK + 500)
    await first.report(MARK + 100)
    await first.close()
    again = await registries("10.0.0.1:8080", 1023).register()
    assert (again.worker_id, again.high_water_ms) == (lease.worker_id, MARK + 500)


async def test_concurrent_addresses_get_distinct_ids(registries: Factory) -> None:
    """Eight workers registering at once get eight different IDs, all within the layout."""
    leases = await asyncio.gather(*(registries(f"10.0.0.{i}:8080", 1023).register() for i in range(8)))
    ids = [lease.worker_id for lease in leases]
    assert len(set(ids)) == 8
    assert all(0 <= worker_id <= 1023 for worker_id in ids)


async def test_exhaustion_names_the_limit_and_known_addresses_still_register(registries: Factory) -> None:
    """With room for two IDs a third address is refused (naming 2); the first two still get theirs."""
    holders = [registries(f"10.0.0.{i}:8080", 1) for i in (1, 2)]
    ids = [(await holder.register()).worker_id for holder in holders]
    assert sorted(ids) == [0, 1]
    with pytest.raises(WorkerIdsExhausted, match=r"all 2 worker IDs"):
        await registries("10.0.0.3:8080", 1).register()
    await holders[1].close()  # a restart: the old process is gone before the new one registers
    assert (await registries("10.0.0.2:8080", 1).register()).worker_id == ids[1]
