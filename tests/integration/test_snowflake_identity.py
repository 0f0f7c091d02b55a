"""Worker identity without ``snowflake.address``, and clean restarts.

A worker keeps one identity (and so one worker ID) across restarts, and a clean stop lets the next start
skip waiting out the reserved high-water mark.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.config import Config
from dispenser.ports import SystemClock
from dispenser.registries import open_registration
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.zookeeper import ZooKeeperServer

from .segment_support import ask, client, running_worker
from .snowflake_support import ranges_of, snowflake_config, subject

pytestmark = [pytest.mark.nats]

RESTARTS = 50


def config_for(
    mode: str, nats: NatsServer, state: Path, name: str, hosts: str, *, report_interval: float = 0.2
) -> Config:
    """A worker in ``mode`` with no address configured (the identity comes from ``state``)."""
    return snowflake_config(
        nats.url,
        state,
        name=name,
        mode=mode,
        prefix=name,
        address=None,
        zookeeper_hosts=hosts,
        report_interval=report_interval,
    )


async def restarts_keep_one_id(config: Config) -> None:
    """Register and close ``RESTARTS`` times: one worker ID throughout; a concurrent second one differs."""
    seen = set()
    for _ in range(RESTARTS):
        registration = await open_registration(config.snowflake, config.postgres, SystemClock())
        seen.add(registration.lease.worker_id)
        await registration.close()
    assert len(seen) == 1, seen
    first = await open_registration(config.snowflake, config.postgres, SystemClock())
    second = await open_registration(config.snowflake, config.postgres, SystemClock())
    try:
        assert first.lease.worker_id in seen
        assert second.lease.worker_id != first.lease.worker_id  # same directory, another live worker
    finally:
        await second.close()
        await first.close()


@pytest.mark.zookeeper
async def test_fifty_restarts_keep_one_zookeeper_worker_id(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Leaf's zookeeper mode, no address set: 50 restarts, one worker ID."""
    config = config_for("zookeeper", private_nats, tmp_path / "state", zk_namespace, zookeeper_server.hosts)
    await restarts_keep_one_id(config)


@pytest.mark.postgres
async def test_fifty_restarts_keep_one_postgres_worker_id(
    private_nats: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Postgres mode, no address set: 50 restarts, one worker ID."""
    await migrate(pg_dsn)
    config = snowflake_config(
        private_nats.url,
        tmp_path / "state",
        name="pgmode",
        mode="postgres",
        address=None,
        postgres_dsn=pg_dsn,
    )
    assert config.snowflake.address is None
    await restarts_keep_one_id(config)


@pytest.mark.zookeeper
async def test_a_clean_stop_does_not_make_the_next_start_wait(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """After a clean stop the restart starts from the last millisecond issued, not the reservation.

    The registry holds a mark 2 report intervals ahead; the restart need not wait it out, and issues above
    the last run's IDs.
    """
    config = config_for(
        "zookeeper",
        private_nats,
        tmp_path / "state",
        zk_namespace,
        zookeeper_server.hosts,
        report_interval=3.0,
    )
    prefix = zk_namespace
    async with client(private_nats.url) as nc:
        async with running_worker(config) as worker:
            reply = await ask(nc, subject(prefix), b'{"count": 20, "format": "ranges"}')
            issued = ranges_of(reply)
            last_ms = worker.snowflake._state.last_ms
            reserved = worker.snowflake._reserved_ms
            assert reserved >= SystemClock().wall_ms() + 4_000  # the reservation reaches ~6 s ahead
        async with running_worker(config) as again:
            assert again.registration.lease.high_water_ms == last_ms
            assert again.snowflake.worker_id == worker.snowflake.worker_id
            later = ranges_of(await ask(nc, subject(prefix), b'{"count": 20, "format": "ranges"}'))
    assert min(first for first, _ in later) > max(last for _, last in issued)
