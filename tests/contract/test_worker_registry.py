"""The WorkerRegistry contract, written once and run against every implementation of the port.

The five: the in-memory fake (``dispenser.testing``), ``postgres`` (a worker table), ``zookeeper`` (Leaf's
layout: a persistent sequential node per address), ``zookeeper-lease`` (an ephemeral claim per worker ID,
with a persistent high-water node) and ``static`` (a configured ID). Real servers, fresh per test: a
database of the test's own (``pg_dsn``), a registry name of its own on the session's ZooKeeper
(``zk_namespace``).

What every registry promises: a lease within the layout, issuing only while registered, and a recorded mark
that never goes down. What the registries that hand out IDs (all but ``static``) promise besides: distinct IDs
to live workers, exhaustion named with its limit, and a restarted worker back on its ID, above the mark it
reported. ``static`` records no mark itself: its record is the worker's local state file
(``SnowflakeRegistration``, ``tests/integration/test_worker_registries.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.adapters.postgres.workers import PostgresWorkerRegistry
from dispenser.adapters.zookeeper.lease import ZooKeeperLeaseRegistry
from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry
from dispenser.core.errors import CoordinatorUnavailable, WorkerIdsExhausted
from dispenser.ports import WorkerRegistry
from dispenser.testing.fakes import MemoryWorkerRegistry, MemoryWorkerTable
from dispenser_lab.servers.zookeeper import ZooKeeperServer

MARK = time.time_ns() // 1_000_000 + 600_000
"""A mark ahead of the clock (a reservation): Leaf's layout also stamps its node with the time it registers."""

Factory = Callable[[int, int], WorkerRegistry]
"""``(worker, max_worker_id)`` → a registry for worker number ``worker`` of one fleet sharing one record.

Worker ``n`` is the address ``10.0.0.<n>:8080`` (the ``static`` worker ``n`` is configured with ID ``n``);
asking again for the same ``n`` is that worker restarted.
"""


@dataclass(frozen=True)
class Kind:
    """One implementation, and which parts of the contract it takes part in."""

    name: str
    assigns_ids: bool = True
    """Hands out worker IDs (all but ``static``, whose ID is configured)."""
    marks: pytest.MarkDecorator | None = None

    def param(self) -> object:
        """This implementation as a pytest parameter, marked with the server it needs."""
        return pytest.param(self, id=self.name, marks=[self.marks] if self.marks else [])


MEMORY = Kind("memory")
STATIC = Kind("static", assigns_ids=False)
POSTGRES = Kind("postgres", marks=pytest.mark.postgres)
ZOOKEEPER = Kind("zookeeper", marks=pytest.mark.zookeeper)
LEASE = Kind("zookeeper-lease", marks=pytest.mark.zookeeper)

EVERY = [kind.param() for kind in (MEMORY, STATIC, POSTGRES, ZOOKEEPER, LEASE)]
ASSIGNING = [kind.param() for kind in (MEMORY, POSTGRES, ZOOKEEPER, LEASE)]


def _address(worker: int) -> str:
    return f"10.0.0.{worker}:8080"


def _factory(kind: Kind, request: pytest.FixtureRequest, made: list[WorkerRegistry]) -> Factory:
    """The registries of ``kind`` over one fresh record, each remembered in ``made`` to be closed."""
    if kind is MEMORY:
        table = MemoryWorkerTable()

        def build(worker: int, max_worker_id: int) -> WorkerRegistry:
            return MemoryWorkerRegistry(table, _address(worker), max_worker_id=max_worker_id)

    elif kind is STATIC:

        def build(worker: int, max_worker_id: int) -> WorkerRegistry:
            return StaticRegistry(worker, max_worker_id=max_worker_id)

    elif kind is POSTGRES:
        dsn: str = request.getfixturevalue("pg_dsn")

        def build(worker: int, max_worker_id: int) -> WorkerRegistry:
            return PostgresWorkerRegistry(dsn, _address(worker), max_worker_id=max_worker_id)

    else:
        server: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        name: str = request.getfixturevalue("zk_namespace")
        registry_class = ZooKeeperRegistry if kind is ZOOKEEPER else ZooKeeperLeaseRegistry

        def build(worker: int, max_worker_id: int) -> WorkerRegistry:
            return registry_class(server.hosts, name, _address(worker), max_worker_id=max_worker_id)

    def factory(worker: int, max_worker_id: int) -> WorkerRegistry:
        made.append(build(worker, max_worker_id))
        return made[-1]

    return factory


async def _registries(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[WorkerRegistry] = []
    yield _factory(request.param, request, made)
    await asyncio.gather(*(registry.close() for registry in made), return_exceptions=True)


@pytest.fixture(params=EVERY)
async def registries(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """Every implementation: a factory of registries over one fresh record, all closed afterwards."""
    async for factory in _registries(request):
        yield factory


@pytest.fixture(params=ASSIGNING)
async def assigning(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """The implementations that hand out worker IDs (all but ``static``), as :func:`registries`."""
    async for factory in _registries(request):
        yield factory


async def test_a_lease_is_within_the_layout_and_issues_only_while_registered(registries: Factory) -> None:
    """No issuing before register(); a first lease is in the layout with no mark; close() ends the issuing."""
    registry = registries(3, 1023)
    assert not registry.can_issue()
    lease = await registry.register()
    assert 0 <= lease.worker_id <= 1023
    assert lease.high_water_ms == 0
    assert registry.can_issue()
    await registry.close()
    assert not registry.can_issue()


async def test_a_report_before_register_is_refused_as_an_outage(assigning: Factory) -> None:
    """report() with no lease yet writes nothing and raises CoordinatorUnavailable (keep calling), never issuing."""
    registry = assigning(2, 1023)
    with pytest.raises(CoordinatorUnavailable):
        await registry.report(MARK)
    assert not registry.can_issue()
    lease = await registry.register()
    assert lease.high_water_ms == 0


async def test_the_recorded_mark_never_goes_down(registries: Factory) -> None:
    """A lower report after a higher one is ignored: registering again gives the same ID and the higher mark."""
    registry = registries(1, 1023)
    lease = await registry.register()
    await registry.report(MARK + 500)
    await registry.report(MARK + 100)
    again = await registry.register()
    assert (again.worker_id, again.high_water_ms) == (lease.worker_id, MARK + 500)
    assert registry.can_issue()


async def test_a_restarted_worker_gets_its_id_back_above_its_mark(assigning: Factory) -> None:
    """Report (a lower report is ignored), close, start again: the same ID, with the highest mark reported."""
    first = assigning(1, 1023)
    lease = await first.register()
    await first.report(MARK + 500)
    await first.report(MARK + 100)
    await first.close()
    again = await assigning(1, 1023).register()
    assert (again.worker_id, again.high_water_ms) == (lease.worker_id, MARK + 500)


async def test_concurrent_workers_get_distinct_ids(assigning: Factory) -> None:
    """Eight workers registering at once get eight different IDs, all within the layout."""
    leases = await asyncio.gather(*(assigning(worker, 1023).register() for worker in range(8)))
    ids = [lease.worker_id for lease in leases]
    assert len(set(ids)) == 8
    assert all(0 <= worker_id <= 1023 for worker_id in ids)


async def test_exhaustion_names_the_limit_and_a_restart_still_registers(assigning: Factory) -> None:
    """With room for two IDs a third worker is refused (naming 2); a holder restarted gets its ID back."""
    holders = [assigning(worker, 1) for worker in (1, 2)]
    ids = [(await holder.register()).worker_id for holder in holders]
    assert sorted(ids) == [0, 1]
    with pytest.raises(WorkerIdsExhausted, match=r"all 2 worker IDs"):
        await assigning(3, 1).register()
    await holders[1].close()  # a restart: the old process is gone before the new one registers
    assert (await assigning(2, 1).register()).worker_id == ids[1]
