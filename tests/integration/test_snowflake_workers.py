"""Snowflake worker processes: a million IDs from two at once, and crashes followed by a clock rollback."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from nats.aio.client import Client

from dispenser.config import load_config
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.zookeeper import ZooKeeperServer

from .segment_support import WorkerProcess, client, running_worker, wait_serving
from .snowflake_support import (
    ShiftableClock,
    assert_unique,
    decoded,
    max_timestamp,
    snowflake_env,
    subject,
    take,
    worker_id_of,
)

pytestmark = [pytest.mark.nats]


def serve(nats_server: NatsServer, log: Path, env: dict[str, str]) -> WorkerProcess:
    """`dispenser serve` in a child process, snowflake only (the Postgres DSN is never used)."""
    return WorkerProcess(nats_server.url, "postgresql://unused@127.0.0.1:1/unused", log, **env)


@pytest.mark.zookeeper
@pytest.mark.slow
async def test_two_processes_issue_a_million_unique_ids(
    nats_server: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Two `dispenser serve` processes (zookeeper mode) share 1,000,000+ IDs: all unique, none negative."""
    workers = [
        serve(
            nats_server,
            tmp_path / f"worker{n}.log",
            snowflake_env(
                nats_server.url,
                tmp_path / f"state{n}",
                name=zk_namespace,
                mode="zookeeper",
                prefix="million",
                zookeeper_hosts=zookeeper_server.hosts,
                address=f"10.0.1.{n}:8080",
            ),
        )
        for n in (1, 2)
    ]
    for worker in workers:
        worker.start()
    try:
        async with client(nats_server.url) as probe:
            for worker in workers:
                await worker.wait_ready(probe, subject("million"))
            await wait_serving(probe, 2)

        async def draw(requests: int, count: int, fmt: str) -> list[tuple[int, int]]:
            ranges: list[tuple[int, int]] = []
            async with client(nats_server.url) as nc:
                for _ in range(requests):
                    ranges += await take(nc, subject("million"), count, fmt)
            return ranges

        per_client = await asyncio.gather(
            *(draw(10, 25_000, "ranges") for _ in range(4)),  # 1,000,000 as ranges
            *(draw(10, 1_000, "ids") for _ in range(4)),  # 40,000 as single IDs
        )
    finally:
        for worker in workers:
            worker.stop()
    everything = [r for ranges in per_client for r in ranges]
    assert assert_unique(everything) == 1_040_000
    assert min(first for first, _ in everything) > 0
    assert len({decoded(last).worker_id for _, last in everything}) == 2  # both processes served
    for worker in workers:
        assert "Traceback" not in worker.log_path.read_text()


async def draw_for(nc: Client, subject_: str, seconds: float) -> list[tuple[int, int]]:
    """Ask for ranges of 4,000 IDs back to back for ``seconds``: most milliseconds of the span get used."""
    ranges: list[tuple[int, int]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ranges += await take(nc, subject_, 4000, "ranges")
    return ranges


@pytest.mark.slow
@pytest.mark.parametrize("address", ["10.0.2.1:8080", None], ids=["address", "default-address"])
async def test_crash_then_restart_with_clock_back_never_repeats(
    nats_server: NatsServer, tmp_path: Path, zk_namespace: str, address: str | None
) -> None:
    """Leaf #216: SIGKILL a worker, restart it with the clock 1 s back (inside the reservation): no ID repeats.

    With no address configured, the default (IP and process ID) differs between the two runs: the static
    worker ID's record must be found all the same.
    """
    state = tmp_path / "state"
    # report_interval 1 s: the reservation reaches 2 s ahead of the clock, so a 1 s rollback is inside it.
    env = snowflake_env(
        nats_server.url,
        state,
        name=zk_namespace,
        prefix="crash",
        worker_id=9,
        address=address,
        report_interval=1.0,
    )
    process = serve(nats_server, tmp_path / "worker.log", env)
    async with client(nats_server.url) as nc:
        process.start()
        try:
            await process.wait_ready(nc, subject("crash"))
            before = await draw_for(nc, subject("crash"), 1.2)
            process.signal(signal.SIGKILL)
            assert await asyncio.to_thread(process.wait) == -signal.SIGKILL
        finally:
            process.stop()
        clock = ShiftableClock(-1000)
        config = load_config(environ=env)  # the killed process's settings, now in this process
        # Without the recorded reservation, the restarted worker would reuse the last second's milliseconds.
        assert clock.wall_ms() <= max_timestamp(before) - 300
        async with running_worker(config, clock) as worker:
            assert worker_id_of(worker) == 9
            after = await draw_for(nc, subject("crash"), 0.8)
    total = sum(last - first + 1 for first, last in before + after)
    assert assert_unique(before + after) == total
    assert min(first for first, _ in after) > max(last for _, last in before)
