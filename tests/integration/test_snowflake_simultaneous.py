"""Two workers on one snowflake ID, started within a millisecond on two NATS servers: at most one serves.

A fleet-wide configuration push starts workers in two datacenters (or on two servers of one cluster) at
once. Interest in a subject crosses routes and gateways asynchronously, so a check sent right after
subscribing may miss the other worker's answerer while the other's check misses ours. The guards run in
this process (``dispenser.adapters.nats.peers.join_peers``, what ``Worker.start`` runs), one connection
per server, so that a hundred pairs take seconds rather than a hundred subprocesses.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from dispenser.adapters.nats.peers import join_peers
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.service.identity import IdentityGuard
from dispenser_lab.faultproxy import ThreadedFaultProxy
from dispenser_lab.servers import NatsCluster, NatsGateways, NatsServer
from dispenser_lab.servers.process import LOOPBACK, free_port
from tests.conftest import _running
from tests.ha.cluster_support import _running as running_group

pytestmark = [pytest.mark.nats]

PAIRS = 120
"""Pairs started per topology; at least ``STARTS`` of them must start within ``SKEW_S`` of each other."""
STARTS = 100
SKEW_S = 0.001
AT_ONCE = 10
"""Pairs started together (each on its own subject): the servers are busy, as in a fleet-wide push."""
WINDOW_S = 0.1
"""``snowflake.peer_check_timeout`` as the fast tests set it (the default is 0.3 s)."""

_subjects = itertools.count(1)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsGateways]:
    """Two datacenters, a NATS server each, joined by gateways."""
    yield from running_group(NatsGateways(tmp_path_factory.mktemp("gateways")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Two NATS servers routed into one cluster."""
    yield from running_group(NatsCluster(tmp_path_factory.mktemp("cluster"), size=2))


ONE_WAY_S = 0.05
"""Between the two servers of the distant cluster, each way (the issue's "50 ms between the nodes")."""
DISTANT_WINDOW_S = 0.3
"""The default ``snowflake.peer_check_timeout``: more than a round trip between the servers."""


def _member(number: int, route_port: int, route_to: int | None) -> str:
    """A member of the cluster ``distant``: its route port, and (member 2) its one route, to the proxy."""
    routes = f'  routes: ["nats-route://{LOOPBACK}:{route_to}"]\n' if route_to is not None else ""
    return (
        f"server_name: distant-{number}\n"
        f'cluster {{\n  name: distant\n  listen: "{LOOPBACK}:{route_port}"\n{routes}}}\n'
    )


@pytest.fixture(scope="module")
def distant_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two servers of one cluster whose only route crosses a fault proxy adding ``ONE_WAY_S`` each way."""
    base = tmp_path_factory.mktemp("distant")
    route_port = free_port()
    first = NatsServer(base / "nats1", free_port(), config=_member(1, route_port, None))
    for one in _running(first):
        with ThreadedFaultProxy((LOOPBACK, route_port)) as proxy:
            proxy.latency(ONE_WAY_S)
            second = NatsServer(base / "nats2", free_port(), config=_member(2, free_port(), proxy.port))
            for two in _running(second):
                yield one.url, two.url


async def routed(url_a: str, url_b: str) -> None:
    """Wait until a subscription on ``url_a``'s server is heard from ``url_b``'s (the route is up): 10 s at most."""
    a, b = await connected(url_a), await connected(url_b)
    try:

        async def pong(msg: Msg) -> None:
            await msg.respond(b"ok")

        await a.subscribe("routed.probe", cb=pong)
        await a.flush()
        deadline = time.monotonic() + 10
        while True:
            try:
                await b.request("routed.probe", b"", timeout=0.5)
                return
            except (TimeoutError, nats.errors.NoRespondersError):
                assert time.monotonic() < deadline, "the route between the two servers never came up"
                await asyncio.sleep(0.1)
    finally:
        await a.close()
        await b.close()


async def connected(url: str) -> Client:
    return await nats.connect(url)


async def start(nc: Client, subject: str, guard: IdentityGuard, window: float) -> tuple[float, str]:
    """One worker's start-up check; returns when it began (monotonic) and the verdict."""
    began = time.monotonic()
    answerer, _ = await join_peers(nc, subject, lambda: int(time.time() * 1000), window, guard)
    await answerer.unsubscribe()
    return began, guard.state


async def pair(a: Client, b: Client, window: float) -> tuple[float, list[str]]:
    """Two guards on one (datacenter, worker) ID, one per server, started together: skew and verdicts."""
    subject = f"simultaneous{next(_subjects)}.snowflake-clock"
    guards = [IdentityGuard(0, lambda: 7, f"10.0.0.{n}:7", layout=SnowflakeLayout()) for n in (1, 2)]
    (began_a, state_a), (began_b, state_b) = await asyncio.gather(
        start(a, subject, guards[0], window), start(b, subject, guards[1], window)
    )
    return abs(began_a - began_b), [state_a, state_b]


async def trials(
    url_a: str, url_b: str, pairs: int = PAIRS, at_once: int = AT_ONCE, window: float = WINDOW_S
) -> tuple[int, int, list[list[str]]]:
    """``pairs`` pairs, ``at_once`` at a time: (pairs within the skew, pairs where both served, all verdicts)."""
    a, b = await connected(url_a), await connected(url_b)
    try:
        results: list[tuple[float, list[str]]] = []
        for _ in range(pairs // at_once):
            results += await asyncio.gather(*(pair(a, b, window) for _ in range(at_once)))
    finally:
        await a.close()
        await b.close()
    close = [states for skew, states in results if skew <= SKEW_S]
    both = sum(states.count("serving") == 2 for states in close)
    return len(close), both, [states for _, states in results]


async def test_a_hundred_simultaneous_starts_across_a_gateway_never_both_serve(
    gateways: NatsGateways,
) -> None:
    """dc-a and dc-b, one worker each on the same ID, started within 1 ms: never both serving."""
    close, both, verdicts = await trials(gateways.url_of("dc-a"), gateways.url_of("dc-b"))
    assert close >= STARTS
    assert both == 0, verdicts
    assert all("refused" in states for states in verdicts)  # every pair: one refusal at least


async def test_a_hundred_simultaneous_starts_across_a_cluster_never_both_serve(cluster: NatsCluster) -> None:
    """Two servers of one cluster, one worker each on the same ID, started within 1 ms: never both serving."""
    first, second = cluster.urls
    close, both, verdicts = await trials(first, second)
    assert close >= STARTS
    assert both == 0, verdicts
    assert all("refused" in states for states in verdicts)


async def test_simultaneous_starts_50_ms_apart_never_both_serve(distant_cluster: tuple[str, str]) -> None:
    """A route 50 ms each way: a check sent at once misses the other's answerer; the second one does not."""
    await routed(*distant_cluster)
    await routed(*reversed(distant_cluster))
    close, both, verdicts = await trials(*distant_cluster, pairs=60, at_once=30, window=DISTANT_WINDOW_S)
    assert close >= 50
    assert both == 0, verdicts
    assert all("refused" in states for states in verdicts)
