"""Worker IDs from a real PostgreSQL (``postgres`` mode) and from configuration (``static`` mode)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.statefile import LocalState
from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.adapters.postgres.workers import PostgresWorkerRegistry
from dispenser.config import PostgresConfig, SnowflakeConfig
from dispenser.core.errors import (
    CoordinatorUnavailable,
    LeaseLost,
    WorkerIdOutOfRange,
    WorkerIdsExhausted,
)
from dispenser.ports import SystemClock, WorkerLease
from dispenser.registries import open_registration
from dispenser_lab.servers import free_port


def pg(dsn: str, address: str, max_worker_id: int = 1023) -> PostgresWorkerRegistry:
    return PostgresWorkerRegistry(
        dsn, address, max_worker_id=max_worker_id, connect_timeout=2, command_timeout=2
    )


# --- postgres ---------------------------------------------------------------------------------------------


@pytest.mark.postgres
async def test_postgres_same_address_gets_same_id_and_high_water(pg_dsn: str) -> None:
    """A restarted worker with the same address gets its ID back, with the high water it reported."""
    first = pg(pg_dsn, "10.0.0.1:8080")
    got = await first.register()
    assert got.high_water_ms == 0
    await first.report(1_700_000_000_500)
    await first.report(1_700_000_000_100)  # lower: ignored
    await first.close()
    again = await pg(pg_dsn, "10.0.0.1:8080").register()
    assert (again.worker_id, again.high_water_ms) == (got.worker_id, 1_700_000_000_500)


@pytest.mark.postgres
async def test_postgres_concurrent_workers_get_distinct_ids(pg_dsn: str) -> None:
    """Eight workers registering at once (table not yet created) get IDs 0 to 7, each a different one."""
    registries = [pg(pg_dsn, f"10.0.0.{i}:8080") for i in range(8)]
    leases = await asyncio.gather(*(r.register() for r in registries))
    assert sorted(lease.worker_id for lease in leases) == list(range(8))


@pytest.mark.postgres
async def test_postgres_reuses_the_smallest_free_id(pg_dsn: str) -> None:
    """An ID whose row was deleted by an operator goes to the next new address."""
    for i in range(3):
        await pg(pg_dsn, f"10.0.0.{i}:8080").register()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("DELETE FROM dispenser_snowflake_worker WHERE worker_id = 1")
    finally:
        await conn.close()
    assert (await pg(pg_dsn, "10.0.0.9:8080").register()).worker_id == 1


@pytest.mark.postgres
async def test_postgres_exhaustion_names_the_limit(pg_dsn: str) -> None:
    """With a 1-bit worker field two addresses register; the third fails, naming the limit of 2."""
    ids = [(await pg(pg_dsn, f"10.0.0.{i}:8080", max_worker_id=1).register()).worker_id for i in (1, 2)]
    assert ids == [0, 1]
    with pytest.raises(WorkerIdsExhausted, match=r"all 2 worker IDs \(0 to 1\)"):
        await pg(pg_dsn, "10.0.0.3:8080", max_worker_id=1).register()
    # An address that already has its ID still gets it.
    assert (await pg(pg_dsn, "10.0.0.2:8080", max_worker_id=1).register()).worker_id == 1


@pytest.mark.postgres
async def test_postgres_removed_row_means_lease_lost(pg_dsn: str) -> None:
    """If an operator deletes the worker's row, the next report raises LeaseLost and issuing stops."""
    registry = pg(pg_dsn, "10.0.0.1:8080")
    await registry.register()
    assert registry.can_issue()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("DELETE FROM dispenser_snowflake_worker")
    finally:
        await conn.close()
    with pytest.raises(LeaseLost):
        await registry.report(1_700_000_000_000)
    assert not registry.can_issue()


async def test_postgres_down_fails_quickly_without_the_password() -> None:
    """With nothing listening, register raises CoordinatorUnavailable quickly, and the password is hidden."""
    registry = pg(f"postgresql://dispenser:s3cret-pw@127.0.0.1:{free_port()}/db", "10.0.0.1:8080")
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable) as caught:
        await registry.register()
    assert time.monotonic() - started < 3.0
    assert "s3cret-pw" not in caught.value.message
    assert "s3cret-pw" not in repr(registry)
    assert not registry.can_issue()


# --- static -----------------------------------------------------------------------------------------------


def static_config(state_dir: Path) -> SnowflakeConfig:
    return SnowflakeConfig(mode="static", worker_id=5, worker_bits=5, state_dir=str(state_dir))


async def test_static_id_with_high_water_from_the_state_file(tmp_path: Path) -> None:
    """The configured ID comes back with the high water the previous run saved in the state file."""
    first = await open_registration(static_config(tmp_path), PostgresConfig(), SystemClock())
    assert first.lease == WorkerLease(worker_id=5, high_water_ms=0)
    assert first.can_issue()
    await first.persist(5, 1_700_000_000_700)
    await first.close()
    assert first.cache.load() == LocalState(
        worker_id=5, high_water_ms=1_700_000_000_700, mode="static", registry_name="leaf"
    )
    again = await open_registration(static_config(tmp_path), PostgresConfig(), SystemClock())
    assert again.lease == WorkerLease(worker_id=5, high_water_ms=1_700_000_000_700)
    await again.close()


async def test_static_ignores_state_of_another_id_or_mode(tmp_path: Path) -> None:
    """A state file recorded for another worker ID or mode gives no high water to this one."""
    cache = (await open_registration(static_config(tmp_path), PostgresConfig(), SystemClock())).cache
    for other in (
        LocalState(worker_id=4, high_water_ms=99, mode="static", registry_name="leaf"),
        LocalState(worker_id=5, high_water_ms=99, mode="zookeeper", registry_name="leaf"),
    ):
        cache.save(other)
        registration = await open_registration(static_config(tmp_path), PostgresConfig(), SystemClock())
        assert registration.cache.path == cache.path
        assert registration.lease == WorkerLease(worker_id=5, high_water_ms=0)


async def test_static_register_again_returns_the_reported_high_water() -> None:
    """Registering again (after a lost lease elsewhere in the shell) returns the highest mark reported."""
    registry = StaticRegistry(5, max_worker_id=31)
    assert not registry.can_issue()
    assert await registry.register() == WorkerLease(worker_id=5, high_water_ms=0)
    await registry.report(1_700_000_000_700)
    await registry.report(1_700_000_000_600)  # lower: ignored
    assert await registry.register() == WorkerLease(worker_id=5, high_water_ms=1_700_000_000_700)
    await registry.close()
    assert not registry.can_issue()


def test_static_id_outside_the_layout_is_refused() -> None:
    """A configured ID that does not fit the worker field is refused at construction."""
    with pytest.raises(WorkerIdOutOfRange, match="between 0 and 31"):
        StaticRegistry(32, max_worker_id=31)
    with pytest.raises(WorkerIdOutOfRange):
        StaticRegistry(-1, max_worker_id=31)
