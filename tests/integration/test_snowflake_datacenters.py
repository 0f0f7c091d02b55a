"""Snowflake across two datacenters (Leaf #187): two NATS servers joined by gateways, a ZooKeeper each.

With a datacenter field in the layout, the four workers never issue one ID twice, whether each datacenter
has its own ZooKeeper or one ensemble spans both; misconfigured (no datacenter field, a ZooKeeper each, so
both hand out worker ID 0), the worker that finds its ID claimed by a live peer refuses instead of serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from dispenser.adapters.nats.peers import collect_peer_clocks
from dispenser.app import Worker
from dispenser.config import Config
from dispenser.core.errors import WorkerIdInUse
from dispenser.core.peers import Claim
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.health import check_all
from dispenser.messages import Reply
from dispenser_lab.servers import NatsGateways, ZooKeeperServer
from tests.conftest import _running
from tests.ha.cluster_support import _running as running_group

from .segment_support import client, request
from .snowflake_support import assert_unique, ranges_of, snowflake_config

# Fixtures are what pytest passes; there is no call site to keep short.
# ruff: noqa: PLR0917

pytestmark = [pytest.mark.nats, pytest.mark.zookeeper]

TWITTER = {"datacenter_bits": 5, "worker_bits": 5}
_prefixes = itertools.count(1)


@pytest.fixture(scope="module")
def datacenters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsGateways]:
    """``dc-a`` and ``dc-b``, a NATS server each, joined by gateways (tests keep apart by subject prefix)."""
    yield from running_group(NatsGateways(tmp_path_factory.mktemp("gateways"), ("dc-a", "dc-b")))


@pytest.fixture(scope="module")
def zookeeper_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """``dc-b``'s own ZooKeeper (``dc-a`` uses the session's)."""
    yield from _running(ZooKeeperServer(tmp_path_factory.mktemp("zookeeper-b")))


def config(
    nats_url: str, zk_hosts: str, state_dir: Path, name: str, prefix: str, datacenter_id: int | None = None
) -> Config:
    """A ``zookeeper``-mode snowflake worker; with ``datacenter_id``, in Twitter's 5 + 5 layout."""
    if datacenter_id is None:
        return snowflake_config(
            nats_url, state_dir, name=name, mode="zookeeper", prefix=prefix, zookeeper_hosts=zk_hosts
        )
    return snowflake_config(
        nats_url,
        state_dir,
        name=name,
        mode="zookeeper",
        prefix=prefix,
        zookeeper_hosts=zk_hosts,
        datacenter_id=datacenter_id,
        datacenter_bits=TWITTER["datacenter_bits"],
        worker_bits=TWITTER["worker_bits"],
    )


@contextlib.asynccontextmanager
async def workers(*configs: Config) -> AsyncIterator[list[Worker]]:
    """Workers started at once (as a fleet rolls out), stopped afterwards."""
    started = [Worker(c) for c in configs]
    results = await asyncio.gather(*(w.start() for w in started), return_exceptions=True)
    try:
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield started
    finally:
        await asyncio.gather(*(w.stop() for w in started), return_exceptions=True)


async def draw(nc: Client, prefix: str, requests: int, count: int = 100, timeout: float = 5.0) -> list[Reply]:
    """``requests`` snowflake requests at once from one datacenter's caller."""
    body = f'{{"count": {count}, "format": "ranges"}}'.encode()
    messages = await asyncio.gather(
        *(request(nc, f"{prefix}.snowflake.order", body, timeout=timeout) for _ in range(requests))
    )
    return [msgspec.json.decode(m.data, type=Reply) for m in messages]


@pytest.mark.parametrize("zookeepers", ["one per datacenter", "one spanning both"])
async def test_four_workers_in_two_datacenters_never_issue_one_id_twice(
    datacenters: NatsGateways,
    zookeeper_server: ZooKeeperServer,
    zookeeper_b: ZooKeeperServer,
    tmp_path: Path,
    zk_namespace: str,
    zookeepers: str,
) -> None:
    """datacenter_id 0 and 1: IDs from all four are unique, and the peer checks hear across the gateway."""
    prefix = f"dc{next(_prefixes)}"
    zk_b = zookeeper_b.hosts if zookeepers == "one per datacenter" else zookeeper_server.hosts
    configs = [
        config(
            datacenters.url_of(dc),
            zk,
            tmp_path / f"{dc}{n}",
            zk_namespace,
            prefix,
            datacenter_id=dc_id,
        )
        for dc, dc_id, zk in (("dc-a", 0, zookeeper_server.hosts), ("dc-b", 1, zk_b))
        for n in (1, 2)
    ]
    async with (
        workers(*configs) as fleet,
        client(datacenters.url_of("dc-a")) as a,
        client(datacenters.url_of("dc-b")) as b,
    ):
        # Each datacenter numbers its workers on its own (its own ZooKeeper, or its own namespace in one).
        assert [(w.config.snowflake.datacenter_id, w.snowflake.worker_id) for w in fleet] in (
            [(0, 0), (0, 1), (1, 0), (1, 1)],
            [(0, 1), (0, 0), (1, 0), (1, 1)],
            [(0, 0), (0, 1), (1, 1), (1, 0)],
            [(0, 1), (0, 0), (1, 1), (1, 0)],
        )
        started = time.monotonic()
        replies = [
            r for batch in await asyncio.gather(draw(a, prefix, 100), draw(b, prefix, 100)) for r in batch
        ]
        took = time.monotonic() - started
        ranges = [r for reply in replies for r in ranges_of(reply)]
        assert assert_unique(ranges) == 200 * 100
        layout = SnowflakeLayout(**TWITTER)
        pairs = {(f.datacenter_id, f.worker_id) for f in (layout.decompose(first) for first, _ in ranges)}
        assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}  # every worker served (a caller's own datacenter's)

        # The peer checks cross the gateway: a caller in dc-a hears the clocks and claims of all four.
        heard = await collect_peer_clocks(
            a, f"{prefix}.snowflake-clock", lambda: int(time.time() * 1000), 1.0, 4
        )
        assert len(heard.readings) == 4
        assert all(abs(r.offset_ms) < 1000 for r in heard.readings)
        assert {(c.node, c.state) for c in heard.claims} == {(p, "serving") for p in pairs}
        assert all(w.identity_guard.refusal is None for w in fleet)
        results = {r.name: r for r in await check_all(fleet[0].config)}
        assert results["snowflake peers"].ok, results["snowflake peers"].detail
    assert took < 10


async def test_leaf_187_a_zookeeper_each_and_no_datacenter_field_is_refused_not_served(
    datacenters: NatsGateways,
    zookeeper_server: ZooKeeperServer,
    zookeeper_b: ZooKeeperServer,
    tmp_path: Path,
    zk_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Leaf's layout, a ZooKeeper per datacenter: both hand out worker IDs 0 and 1.

    dc-b's workers, started second, hear dc-a's claim the same IDs and refuse (worker_id_in_use, one log
    line, `check` fails) and stay out of the queue group, so that dc-b's callers are served by dc-a across
    the gateway; dc-a's keep serving, and no ID is issued twice.
    """
    prefix = f"dc{next(_prefixes)}"

    def configs(dc: str, zk: str) -> list[Config]:
        return [
            config(datacenters.url_of(dc), zk, tmp_path / f"{dc}{n}", zk_namespace, prefix) for n in (1, 2)
        ]

    async with (
        workers(*configs("dc-a", zookeeper_server.hosts)) as fleet_a,
        workers(*configs("dc-b", zookeeper_b.hosts)) as fleet_b,
        client(datacenters.url_of("dc-a")) as a,
        client(datacenters.url_of("dc-b")) as b,
    ):
        ids = sorted(w.snowflake.worker_id for w in (*fleet_a, *fleet_b))
        assert ids == [0, 0, 1, 1]  # the misconfiguration: the same worker IDs in both datacenters
        for worker in fleet_b:
            assert worker.identity_guard.state == "refused"
        for worker in fleet_a:
            assert worker.identity_guard.state == "serving"
            assert len(worker.identity_guard.turned_away) == 1

        for worker in fleet_b:  # never joined the snowflake queue group
            assert worker.service.left == {"snowflake"}
            assert [e.name for e in worker.service.service.endpoints] == []
            assert isinstance(worker.snowflake.refusal, WorkerIdInUse)
        before = sum(w.service.service.endpoints[0].num_requests for w in fleet_a)
        across = await draw(b, prefix, 20)  # dc-b's callers: answered by dc-a across the gateway
        assert all(r.error is None for r in across), [r.error for r in across if r.error]
        after = sum(w.service.service.endpoints[0].num_requests for w in fleet_a)
        assert after - before == 20
        served = await draw(a, prefix, 50)
        ranges = [r for reply in (*across, *served) for r in ranges_of(reply)]
        assert assert_unique(ranges) == 70 * 100
        layout = SnowflakeLayout()
        assert {layout.decompose(first).worker_id for first, _ in ranges} <= {
            w.snowflake.worker_id for w in fleet_a
        }

        lines = [r.getMessage() for r in caplog.records if r.name == "dispenser.service.identity"]
        refusals = [line for line in lines if "is also claimed by the live worker" in line]
        assert len(refusals) == 2  # one line per refusing worker
        assert "snowflake.datacenter_id" in refusals[0]
        results = {r.name: r for r in await check_all(fleet_a[0].config)}
        assert not results["snowflake peers"].ok
        assert "datacenter 0, worker 0" in results["snowflake peers"].detail
        assert "refused" in results["snowflake peers"].detail


async def test_two_workers_starting_at_once_on_one_id_never_both_serve(
    datacenters: NatsGateways,
    zookeeper_server: ZooKeeperServer,
    zookeeper_b: ZooKeeperServer,
    tmp_path: Path,
    zk_namespace: str,
) -> None:
    """The same (datacenter, worker) ID in both datacenters, started together: at most one serves.

    (Here both usually refuse, each hearing the other's check while it is still starting.)
    """
    prefix = f"dc{next(_prefixes)}"
    async with workers(
        config(datacenters.url_of("dc-a"), zookeeper_server.hosts, tmp_path / "a", zk_namespace, prefix),
        config(datacenters.url_of("dc-b"), zookeeper_b.hosts, tmp_path / "b", zk_namespace, prefix),
    ) as fleet:
        assert [w.snowflake.worker_id for w in fleet] == [0, 0]
        states = [w.identity_guard.state for w in fleet]
        assert states.count("serving") <= 1, states
        assert "refused" in states
        for worker, state in zip(fleet, states, strict=True):  # a refused worker takes no requests
            assert ("snowflake" in worker.service.left) == (state == "refused")


async def test_a_worker_refused_while_serving_leaves_and_its_callers_cross(
    datacenters: NatsGateways,
    zookeeper_server: ZooKeeperServer,
    zookeeper_b: ZooKeeperServer,
    tmp_path: Path,
    zk_namespace: str,
) -> None:
    """A serving worker that hears a serving rival on its ID refuses and leaves the queue group at once.

    Its datacenter's callers are then served by the other datacenter's worker, not answered with errors.
    """
    prefix = f"dc{next(_prefixes)}"
    async with (
        workers(
            config(
                datacenters.url_of("dc-a"), zookeeper_server.hosts, tmp_path / "a", zk_namespace, prefix, 0
            ),
            config(datacenters.url_of("dc-b"), zookeeper_b.hosts, tmp_path / "b", zk_namespace, prefix, 1),
        ) as (a_worker, _),
        client(datacenters.url_of("dc-a")) as a,
    ):
        at_home = await draw(a, prefix, 10)
        layout = SnowflakeLayout(**TWITTER)
        assert {layout.decompose(r[0]).datacenter_id for reply in at_home for r in ranges_of(reply)} == {0}

        guard = a_worker.identity_guard
        own = guard.claim()
        guard.hear(Claim(own.datacenter_id, own.worker_id, "rival", "serving", "10.0.0.9:1"))
        assert a_worker.service.left == {"snowflake"}
        # The drain runs in a task: requests may still reach this worker (and get the refusal) meanwhile.
        # One routed to it just as it unsubscribed may also go unanswered: nats-server can deliver a message
        # after the UNSUB and the flush that ends nats-py's drain (a publisher holding a cached interest
        # list), and nats-py drops a message for a subscription it has removed (a 5 s timeout once in CI).
        # A caller's timeout and retry cover it; here each try waits 1 s, and only until the deadline.
        deadline = time.monotonic() + 6.0
        while True:
            try:
                replies = await draw(a, prefix, 10, timeout=1.0)
            except TimeoutError:
                assert time.monotonic() < deadline, "no answer from either datacenter"
                continue
            if all(r.error is None for r in replies):
                break
            assert {r.error.code for r in replies if r.error} == {WorkerIdInUse.code}
            assert time.monotonic() < deadline, "still answered by the refused worker"
        assert {layout.decompose(r[0]).datacenter_id for reply in replies for r in ranges_of(reply)} == {1}
