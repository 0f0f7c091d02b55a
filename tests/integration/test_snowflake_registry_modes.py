"""Snowflake worker IDs from real registries: ZooKeeper (Leaf's mode and leases) and PostgreSQL, with outages."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import asyncpg
import msgspec
import pytest

from dispenser.config import Config
from dispenser.core.errors import ClockBehindRecorded, CoordinatorUnavailable, WorkerIdsExhausted
from dispenser_lab.servers import NatsServer, free_port
from dispenser_lab.servers.zookeeper import ZooKeeperServer

from .segment_support import WorkerProcess, ask, client, running_worker
from .snowflake_support import (
    ShiftableClock,
    assert_disjoint_increasing,
    assert_unique,
    decoded,
    lease_high_water,
    lease_owner,
    max_timestamp,
    ranges_of,
    refused,
    snowflake_config,
    snowflake_env,
    subject,
    take,
    worker_id_of,
    worker_node,
)
from .zk_support import PartitionProxy, eventually

# These tests reuse subject prefixes and worker IDs: each gets a NATS server of its own (private_nats),
# so that a worker outliving another test (its connection not yet noticed dead) cannot answer here.
pytestmark = [pytest.mark.nats]


ADDRESS_A = "10.0.0.1:8080"
ADDRESS_B = "10.0.0.2:8080"


def zk_config(
    private_nats: NatsServer,
    tmp_path: Path,
    name: str,
    hosts: str,
    *,
    address: str,
    prefix: str,
    mode: str = "zookeeper",
) -> Config:
    """A worker in a ZooKeeper mode, with its own subject prefix (so requests reach it alone)."""
    return snowflake_config(
        private_nats.url,
        tmp_path / "state",
        name=name,
        mode=mode,
        prefix=prefix,
        zookeeper_hosts=hosts,
        address=address,
    )


# --- zookeeper (Leaf's mode) ---------------------------------------------------------------------------


@pytest.mark.zookeeper
async def test_zookeeper_worker_id_is_kept_per_address(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Same address → same worker ID after a restart; another address → another ID; the node records the last ms."""
    hosts = zookeeper_server.hosts
    a = zk_config(private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_A, prefix="a")
    b = zk_config(private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_B, prefix="b")
    async with client(private_nats.url) as nc:
        async with running_worker(a) as first, running_worker(b) as second:
            id_a, id_b = worker_id_of(first), worker_id_of(second)
            assert id_a != id_b
            issued = await take(nc, subject("a"), 5000, "ranges")
            other = await take(nc, subject("b"), 5000, "ranges")
        assert {decoded(last).worker_id for _, last in issued} == {id_a}
        assert {decoded(last).worker_id for _, last in other} == {id_b}
        node_id, recorded = await worker_node(hosts, zk_namespace, ADDRESS_A)
        assert node_id == id_a
        assert recorded >= max_timestamp(issued)
        async with running_worker(a) as again:
            assert worker_id_of(again) == id_a
            issued += await take(nc, subject("a"), 100)
    assert_disjoint_increasing(issued)
    assert assert_unique(issued + other) == 10_100


@pytest.mark.zookeeper
async def test_zookeeper_killed_while_serving(
    private_nats: NatsServer, private_zookeeper: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """ZooKeeper killed: the worker keeps serving; ZooKeeper back: the node's timestamp advances again."""
    hosts = private_zookeeper.hosts
    config = zk_config(private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_A, prefix="a")
    issued: list[tuple[int, int]] = []
    slowest = 0.0
    async with running_worker(config), client(private_nats.url) as nc:
        issued += await take(nc, subject("a"), 100)
        await asyncio.to_thread(private_zookeeper.kill)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            started = time.monotonic()
            issued += await take(nc, subject("a"), 500, "ranges")
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.02)
        await asyncio.to_thread(private_zookeeper.start)
        served_down = max_timestamp(issued)

        async def recorded_past_outage() -> None:
            _, recorded = await worker_node(hosts, zk_namespace, ADDRESS_A)
            assert recorded > served_down

        await eventually(recorded_past_outage, timeout=10, what="a report after ZooKeeper came back")
        issued += await take(nc, subject("a"), 100)
    assert_disjoint_increasing(issued)
    assert slowest < 0.5, f"a request took {slowest:.2f} s while ZooKeeper was down"


@pytest.mark.zookeeper
async def test_zookeeper_down_at_start_uses_the_local_cache(
    private_nats: NatsServer, private_zookeeper: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """ZooKeeper down at start with a cache of an earlier run: start from it, serve, register when it is back."""
    hosts = private_zookeeper.hosts
    config = zk_config(private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_A, prefix="a")
    async with client(private_nats.url) as nc:
        async with running_worker(config) as worker:
            worker_id = worker_id_of(worker)
            issued = await take(nc, subject("a"), 1000, "ranges")
        _, recorded = await worker_node(hosts, zk_namespace, ADDRESS_A)
        await asyncio.to_thread(private_zookeeper.stop)
        async with running_worker(config) as worker:
            assert worker.registration.from_cache
            assert worker_id_of(worker) == worker_id
            issued += await take(nc, subject("a"), 1000, "ranges")
            await asyncio.to_thread(private_zookeeper.start)

            async def registered_again() -> None:
                assert (await worker_node(hosts, zk_namespace, ADDRESS_A))[1] > recorded

            await eventually(registered_again, timeout=15, what="a report after ZooKeeper came back")
            issued += await take(nc, subject("a"), 1000, "ranges")
            assert worker_id_of(worker) == worker_id
    assert_disjoint_increasing(issued)


@pytest.mark.zookeeper
async def test_a_cache_from_another_root_is_no_evidence(
    private_nats: NatsServer, private_zookeeper: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """ZooKeeper down at start, and the cache holds an ID of another root's numbering: refuse, not reuse it.

    Moving a worker to another registry root (Leaf's ``/snowflake``, shared) while ZooKeeper is down must not
    start it from the old root's worker ID, which the new root may have given to a live worker.
    """
    config = zk_config(
        private_nats, tmp_path, zk_namespace, private_zookeeper.hosts, address=ADDRESS_A, prefix="a"
    )
    async with running_worker(config):
        pass  # registered under the default root: the cache now holds its worker ID
    await asyncio.to_thread(private_zookeeper.stop)
    moved = msgspec.structs.replace(
        config, snowflake=msgspec.structs.replace(config.snowflake, zookeeper_root="/elsewhere/snowflake")
    )
    error = await refused(moved)
    assert isinstance(error, CoordinatorUnavailable)
    async with running_worker(config) as worker:  # the same root still starts from its cache
        assert worker.registration.from_cache


async def test_zookeeper_down_at_start_without_cache_refuses(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """ZooKeeper down and no cache: Worker.start raises CoordinatorUnavailable, `dispenser serve` exits 1."""
    hosts = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = zk_config(private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_A, prefix="a")
    env = snowflake_env(
        private_nats.url,
        tmp_path / "state",
        name=zk_namespace,
        mode="zookeeper",
        prefix="a",
        zookeeper_hosts=hosts,
        address=ADDRESS_B,
    )
    process = WorkerProcess(private_nats.url, "postgresql://unused", tmp_path / "serve.log", **env)
    process.start()
    try:
        error = await refused(config)
        status = await asyncio.to_thread(process.wait, 30)
    finally:
        process.stop()
    assert isinstance(error, CoordinatorUnavailable)
    assert error.retryable
    assert "no ZooKeeper session" in error.message
    assert hosts not in error.message  # where ZooKeeper is: the log's and the operator's (str), not a reply's
    assert hosts in str(error)
    assert status == 1
    log = process.log_path.read_text()
    assert "cannot start: worker-id coordinator unavailable" in log
    assert hosts in log
    assert "Traceback" not in log


# --- zookeeper-lease ---------------------------------------------------------------------------------------


@pytest.mark.zookeeper
async def test_lease_ids_differ_and_come_back_above_their_high_water(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Two lease workers get different IDs; a stopped worker's ID goes to the next, which issues above it."""
    hosts = zookeeper_server.hosts

    def config(address: str, prefix: str) -> Config:
        return zk_config(
            private_nats,
            tmp_path,
            zk_namespace,
            hosts,
            address=address,
            prefix=prefix,
            mode="zookeeper-lease",
        )

    async with client(private_nats.url) as nc, running_worker(config(ADDRESS_A, "a")) as first:
        async with running_worker(config(ADDRESS_B, "b")) as second:
            freed = worker_id_of(second)
            assert worker_id_of(first) != freed
            issued = await take(nc, subject("b"), 5000, "ranges")
            kept = await take(nc, subject("a"), 5000, "ranges")
        assert await lease_owner(hosts, zk_namespace, freed) is None  # released at once
        assert await lease_high_water(hosts, zk_namespace, freed) >= max_timestamp(issued)
        async with running_worker(config("10.0.0.3:8080", "c")) as third:
            assert worker_id_of(third) == freed
            issued += await take(nc, subject("c"), 5000, "ranges")
            kept += await take(nc, subject("a"), 10)
    assert_disjoint_increasing(issued)
    assert assert_unique(issued + kept) == 15_010


@pytest.mark.zookeeper
async def test_lease_lost_stops_issuing_before_the_id_can_move(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """A partitioned holder answers `lease_lost` while its lease node still stands; the next holder issues above."""
    hosts = zookeeper_server.hosts
    proxy = PartitionProxy(zookeeper_server.port)
    await proxy.start()
    holder_config = zk_config(
        private_nats,
        tmp_path,
        zk_namespace,
        proxy.hosts,
        address=ADDRESS_A,
        prefix="a",
        mode="zookeeper-lease",
    )
    successor_config = zk_config(
        private_nats, tmp_path, zk_namespace, hosts, address=ADDRESS_B, prefix="b", mode="zookeeper-lease"
    )
    try:
        async with running_worker(holder_config) as holder, client(private_nats.url) as nc:
            worker_id = worker_id_of(holder)
            owner = await lease_owner(hosts, zk_namespace, worker_id)
            assert owner is not None
            issued = await take(nc, subject("a"), 1000, "ranges")
            proxy.partition()
            partitioned = time.monotonic()
            refused: list[str] = []
            while True:
                reply = await ask(nc, subject("a"), b'{"count": 1000, "format": "ranges"}')
                if reply.error is None:
                    issued += ranges_of(reply)
                else:
                    # Before the lease is known lost, a request that needs the high-water mark recorded (its
                    # reservation ran out; the write hangs on the partition) may reach its deadline first:
                    # `unavailable`, retryable.
                    assert reply.error.retryable is True, reply.error
                    refused.append(reply.error.code)
                    if reply.error.code == "lease_lost":
                        break
                    assert reply.error.code == "unavailable", reply.error
                assert time.monotonic() - partitioned < 5, (
                    f"no lease_lost long after the partition: {refused}"
                )
                await asyncio.sleep(0.01)
            # The holder stopped while ZooKeeper still keeps its lease node: nobody else can claim the ID yet.
            assert await lease_owner(hosts, zk_namespace, worker_id) == owner
            for _ in range(3):
                again = await ask(nc, subject("a"))
                assert again.error is not None
                assert again.error.code in {"lease_lost", "unavailable"}

            async def expired() -> None:
                assert await lease_owner(hosts, zk_namespace, worker_id) is None

            await eventually(expired, timeout=10, what="the partitioned holder's session expiring")
            async with running_worker(successor_config) as successor:
                assert worker_id_of(successor) == worker_id
                after = await take(nc, subject("b"), 5000, "ranges")
                proxy.heal()  # the old holder comes back under another ID

                async def serving_again() -> list[tuple[int, int]]:
                    return await take(nc, subject("a"), 100)

                back = await eventually(serving_again, timeout=15, what="the old holder leasing another ID")
                after += await take(nc, subject("b"), 100)
    finally:
        await proxy.close()
    # Safety first (no ID twice, the successor above the old holder), then liveness (a new ID for the old).
    assert assert_unique(issued + after + back) == sum(last - first + 1 for first, last in issued) + 5200
    assert min(first for first, _ in after) > max(last for _, last in issued)
    assert {decoded(last).worker_id for _, last in back} != {worker_id}


# --- worker-ID exhaustion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("zookeeper", marks=pytest.mark.zookeeper),
        pytest.param("zookeeper-lease", marks=pytest.mark.zookeeper),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_third_worker_with_one_worker_bit_is_refused(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str, request: pytest.FixtureRequest, mode: str
) -> None:
    """With worker_bits=1 two workers start and the third fails with WorkerIdsExhausted naming the limit."""
    if mode == "postgres":
        hosts, dsn = "", request.getfixturevalue("pg_dsn")
    else:
        hosts, dsn = request.getfixturevalue("zookeeper_server").hosts, None

    def config(n: int) -> Config:
        return snowflake_config(
            private_nats.url,
            tmp_path / "state",
            name=zk_namespace,
            mode=mode,
            prefix=f"w{n}",
            postgres_dsn=dsn,
            zookeeper_hosts=hosts,
            address=f"10.0.0.{n}:8080",
            worker_bits=1,
        )

    async with running_worker(config(1)) as first, running_worker(config(2)) as second:
        assert {worker_id_of(first), worker_id_of(second)} == {0, 1}
        error = await refused(config(3))
    assert isinstance(error, WorkerIdsExhausted)
    assert error.limit == 2
    assert "all 2 worker IDs (0 to 1)" in error.message
    assert "worker bits" in error.message


# --- postgres ------------------------------------------------------------------------------------------------


@pytest.mark.postgres
async def test_postgres_worker_ids_differ_and_are_kept_per_address(
    private_nats: NatsServer, pg_dsn: str, tmp_path: Path, zk_namespace: str
) -> None:
    """Postgres mode: two addresses get different IDs; a restart keeps its ID and issues above its record."""

    def config(address: str, prefix: str) -> Config:
        return snowflake_config(
            private_nats.url,
            tmp_path / "state",
            name=zk_namespace,
            mode="postgres",
            prefix=prefix,
            postgres_dsn=pg_dsn,
            address=address,
        )

    async with client(private_nats.url) as nc:
        async with (
            running_worker(config(ADDRESS_A, "a")) as first,
            running_worker(config(ADDRESS_B, "b")) as second,
        ):
            id_a = worker_id_of(first)
            assert worker_id_of(second) != id_a
            issued = await take(nc, subject("a"), 5000, "ranges")
            other = await take(nc, subject("b"), 5000, "ranges")
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch(
                "SELECT address, worker_id, high_water_ms FROM dispenser_snowflake_worker"
            )
        finally:
            await conn.close()
        recorded = {row["address"]: (row["worker_id"], row["high_water_ms"]) for row in rows}
        assert recorded[ADDRESS_A][0] == id_a
        assert recorded[ADDRESS_A][1] >= max_timestamp(issued)
        assert recorded[ADDRESS_B][1] >= max_timestamp(other)
        async with running_worker(config(ADDRESS_A, "a")) as again:
            assert worker_id_of(again) == id_a
            issued += await take(nc, subject("a"), 100)
    assert_disjoint_increasing(issued)
    assert {decoded(last).worker_id for _, last in issued} == {id_a}
    assert assert_unique(issued + other) == 10_100


@pytest.mark.zookeeper
async def test_zookeeper_record_refuses_a_clock_far_behind(
    private_nats: NatsServer, zookeeper_server: ZooKeeperServer, tmp_path: Path, zk_namespace: str
) -> None:
    """With the local cache gone, the node's recorded timestamp alone refuses a restart 60 s back in time."""
    clock = ShiftableClock()
    config = zk_config(
        private_nats, tmp_path, zk_namespace, zookeeper_server.hosts, address=ADDRESS_A, prefix="a"
    )
    async with running_worker(config, clock), client(private_nats.url) as nc:
        await take(nc, subject("a"), 100)
    shutil.rmtree(tmp_path / "state")
    clock.shift(-60_000)
    error = await refused(config, clock)
    assert isinstance(error, ClockBehindRecorded)
    assert 59_000 < error.recorded_ms - error.now_ms < 61_000
    assert "recorded for this worker by an earlier run" in error.message
