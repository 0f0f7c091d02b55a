"""Worker IDs from a real ZooKeeper: Leaf's ``zookeeper`` mode and the ``zookeeper-lease`` mode."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest

from dispenser.adapters.zookeeper.lease import ZooKeeperLeaseRegistry
from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry
from dispenser.core.errors import (
    CoordinatorUnavailable,
    LeaseLost,
    WorkerAddressInUse,
    WorkerIdsExhausted,
)
from dispenser_lab.servers import free_port
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.integration.zk_support import PartitionProxy, eventually, expire_session, off_loop, plain_client

pytestmark = pytest.mark.zookeeper

# Short timeouts keep outage tests quick: the test server grants sessions from 1 s (tickTime 500 ms).
FAST = {"session_timeout": 2.0, "connect_timeout": 2.0, "op_timeout": 1.0}

# Reported high-water marks: an hour ahead of the clock, so they are above the creation timestamp Leaf's
# mode writes into a new worker node (as the shell's reservations ahead of the clock are).
AHEAD = time.time_ns() // 1_000_000 + 3_600_000


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    """Closes every registry a test opened, whatever happened."""
    async with AsyncExitStack() as s:
        yield s


def forever(hosts: str, name: str, address: str, stack: AsyncExitStack, **kw: Any) -> ZooKeeperRegistry:
    options: dict[str, Any] = {"max_worker_id": 1023, **FAST, **kw}
    registry = ZooKeeperRegistry(hosts, name, address, **options)
    stack.push_async_callback(registry.close)
    return registry


def lease(hosts: str, name: str, address: str, stack: AsyncExitStack, **kw: Any) -> ZooKeeperLeaseRegistry:
    options: dict[str, Any] = {"max_worker_id": 1023, **FAST, **kw}
    registry = ZooKeeperLeaseRegistry(hosts, name, address, **options)
    stack.push_async_callback(registry.close)
    return registry


async def read_json(hosts: str, path: str) -> tuple[dict[str, Any], Any]:
    async with plain_client(hosts) as client:
        data, stat = await off_loop(client.get, path)
    return json.loads(data), stat


async def node_exists(hosts: str, path: str) -> bool:
    async with plain_client(hosts) as client:
        return await off_loop(client.exists, path) is not None


# --- Leaf's mode ------------------------------------------------------------------------------------------


async def test_same_address_gets_same_id_and_high_water_after_restart(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A restarted worker with the same ip:port gets its worker ID back, with the timestamp it reported."""
    first = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.1:8080", stack)
    lease1 = await first.register()
    assert lease1.high_water_ms == 0
    await first.report(AHEAD + 123)
    await first.close()

    second = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.1:8080", stack)
    lease2 = await second.register()
    assert lease2.worker_id == lease1.worker_id
    assert lease2.high_water_ms == AHEAD + 123


async def test_worker_node_is_leafs_sequential_node_with_json(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """The worker node is forever/<ip:port>-<sequence> holding {ip, port, timestamp}, plus a live temporary node."""
    registry = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.7:9000", stack)
    got = await registry.register()
    await registry.report(AHEAD + 456)
    path = f"/leaf/snowflake/{zk_namespace}/forever/10.0.0.7:9000-{got.worker_id:010d}"
    data, _ = await read_json(zookeeper_server.hosts, path)
    assert data == {"ip": "10.0.0.7", "port": "9000", "timestamp": AHEAD + 456}
    _, stat = await read_json(
        zookeeper_server.hosts, f"/leaf/snowflake/{zk_namespace}/temporary/10.0.0.7:9000"
    )
    assert stat.ephemeralOwner == registry.session.session_id


async def test_two_addresses_get_different_ids(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Two workers with different addresses, registering at once, get different worker IDs."""
    a = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.1:8080", stack)
    b = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.2:8080", stack)
    got_a, got_b = await asyncio.gather(a.register(), b.register())
    assert {got_a.worker_id, got_b.worker_id} == {0, 1}


async def test_report_never_lowers_the_recorded_timestamp(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A lower report (the clock went back) leaves the recorded timestamp where it was."""
    registry = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.1:8080", stack)
    await registry.register()
    await registry.report(AHEAD + 2_000)
    await registry.report(AHEAD + 1_000)
    await registry.close()
    again = forever(zookeeper_server.hosts, zk_namespace, "10.0.0.1:8080", stack)
    assert (await again.register()).high_water_ms == AHEAD + 2_000


async def test_ids_past_the_layout_are_refused_naming_the_limit(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """With a 1-bit worker field, two addresses register and the third fails, naming the limit of 2."""
    hosts = zookeeper_server.hosts
    ids = [
        (await forever(hosts, zk_namespace, f"10.0.0.{i}:8080", stack, max_worker_id=1).register()).worker_id
        for i in (1, 2)
    ]
    assert ids == [0, 1]
    third = forever(hosts, zk_namespace, "10.0.0.3:8080", stack, max_worker_id=1)
    with pytest.raises(WorkerIdsExhausted, match=r"all 2 worker IDs \(0 to 1\)") as caught:
        await third.register()
    assert caught.value.limit == 2


async def test_down_at_start_fails_quickly(zk_namespace: str, stack: AsyncExitStack) -> None:
    """With nothing listening, register raises CoordinatorUnavailable within its connect timeout."""
    registry = forever(f"127.0.0.1:{free_port()}", zk_namespace, "10.0.0.1:8080", stack, connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable):
        await registry.register()
    assert time.monotonic() - started < 2.0
    assert not registry.can_issue()


async def test_keeps_issuing_while_zookeeper_is_down_and_reports_when_back(
    private_zookeeper: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """ZooKeeper killed: can_issue stays true and reports fail fast; restarted: reports land again."""
    hosts = private_zookeeper.hosts
    registry = forever(hosts, zk_namespace, "10.0.0.1:8080", stack)
    got = await registry.register()
    private_zookeeper.kill()

    assert registry.can_issue()
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable):
        await registry.report(AHEAD + 5_000)
    assert time.monotonic() - started < 3.0
    await asyncio.sleep(1.0)
    assert registry.can_issue()

    private_zookeeper.start()
    await eventually(lambda: registry.report(AHEAD + 6_000), timeout=15, what="a report after the restart")
    assert registry.can_issue()
    node = f"/leaf/snowflake/{zk_namespace}/forever/10.0.0.1:8080-{got.worker_id:010d}"
    data, _ = await read_json(hosts, node)
    assert data["timestamp"] == AHEAD + 6_000
    _, stat = await read_json(hosts, f"/leaf/snowflake/{zk_namespace}/temporary/10.0.0.1:8080")
    assert stat.ephemeralOwner == registry.session.session_id


@pytest.mark.slow
async def test_a_reconnect_that_gets_no_handshake_answer_is_retried(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A handshake never answered (as while ZooKeeper starts) is retried after op_timeout; the session lives."""
    proxy = PartitionProxy(zookeeper_server.port)
    await proxy.start()
    stack.push_async_callback(proxy.close)
    registry = forever(proxy.hosts, zk_namespace, "10.0.0.1:8080", stack, session_timeout=10.0)
    await registry.register()
    session = registry.session.session_id
    proxy.partition()
    await poll_until(lambda: not registry.session.connected, 8.0)  # kazoo alone: a missed ping, ~T/3 later
    attempts = proxy.accepted
    # A reconnect attempt meanwhile: its connect request is swallowed.
    await poll_until(lambda: proxy.accepted > attempts, 8.0)
    proxy.partitioned = False  # bytes pass again, but no connection is closed: an attempt may be waiting
    started = time.monotonic()
    await eventually(lambda: registry.report(AHEAD + 8_000), timeout=6, what="a report after the silence")
    assert time.monotonic() - started < 4.0  # kazoo alone would wait for the handshake for 10 s
    assert registry.session.session_id == session


async def test_expired_session_is_registered_again(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """After the session expires (ephemeral node gone), the next reports hold the temporary node again."""
    hosts = zookeeper_server.hosts
    registry = forever(hosts, zk_namespace, "10.0.0.1:8080", stack)
    await registry.register()
    old_session = registry.session.session_id
    assert old_session is not None
    temporary = f"/leaf/snowflake/{zk_namespace}/temporary/10.0.0.1:8080"

    await expire_session(hosts, old_session, registry.session.password)
    assert not await node_exists(hosts, temporary)
    assert registry.can_issue()

    async def reported_in_new_session() -> None:
        await registry.report(AHEAD + 7_000)
        assert registry.session.session_id not in (None, old_session)

    await eventually(reported_in_new_session, timeout=15, what="a report in a new session")
    _, stat = await read_json(hosts, temporary)
    assert stat.ephemeralOwner == registry.session.session_id
    assert registry.can_issue()


async def test_restart_after_crash_waits_for_the_old_session(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A worker restarted right after a crash waits for its old ephemeral node to expire, then gets its ID."""
    hosts = zookeeper_server.hosts
    proxy = PartitionProxy(zookeeper_server.port)
    await proxy.start()
    stack.push_async_callback(proxy.close)
    crashed = forever(proxy.hosts, zk_namespace, "10.0.0.1:8080", stack, session_timeout=1.0)
    got = await crashed.register()
    proxy.partition()  # as a crash looks to the server: silence, no close; it keeps the session until expiry

    restarted = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, session_timeout=1.0)
    started = time.monotonic()
    again = await restarted.register()
    waited = time.monotonic() - started
    assert again.worker_id == got.worker_id
    assert 0.3 < waited < 4.0


async def test_a_live_worker_with_the_same_address_is_refused(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A second live worker claiming the same ip:port is refused instead of sharing the worker ID."""
    hosts = zookeeper_server.hosts
    live = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, session_timeout=1.0)
    await live.register()
    twin = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, session_timeout=1.0)
    with pytest.raises(WorkerAddressInUse, match=r"10\.0\.0\.1:8080"):
        await twin.register()
    assert live.can_issue()


# --- lease mode -------------------------------------------------------------------------------------------


async def test_lease_claimants_get_different_ids_until_exhausted(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Two claimants lease IDs 0 and 1 of a 1-bit field; a third is refused, naming the limit of 2."""
    hosts = zookeeper_server.hosts
    a = lease(hosts, zk_namespace, "10.0.0.1:1", stack, max_worker_id=1)
    b = lease(hosts, zk_namespace, "10.0.0.2:1", stack, max_worker_id=1)
    got = await asyncio.gather(a.register(), b.register())
    assert sorted(g.worker_id for g in got) == [0, 1]
    assert a.can_issue()
    assert b.can_issue()
    c = lease(hosts, zk_namespace, "10.0.0.3:1", stack, max_worker_id=1)
    with pytest.raises(WorkerIdsExhausted, match=r"all 2 worker IDs"):
        await c.register()
    assert not c.can_issue()


async def test_released_id_comes_back_with_its_high_water(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A closed holder frees its ID at once; the next claimant gets it with the reported high water."""
    hosts = zookeeper_server.hosts
    old = lease(hosts, zk_namespace, "10.0.0.1:1", stack, max_worker_id=0)
    assert (await old.register()).worker_id == 0
    await old.report(AHEAD + 999)
    await old.report(AHEAD + 111)  # lower: ignored
    await old.close()
    assert not old.can_issue()

    new = lease(hosts, zk_namespace, "10.0.0.2:1", stack, max_worker_id=0)
    got = await new.register()
    assert (got.worker_id, got.high_water_ms) == (0, AHEAD + 999)


async def test_register_again_keeps_a_lease_still_held(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Calling register again while the lease is held returns the same ID with the current high water."""
    registry = lease(zookeeper_server.hosts, zk_namespace, "10.0.0.1:1", stack)
    first = await registry.register()
    await registry.report(42_000)
    second = await registry.register()
    assert (second.worker_id, second.high_water_ms) == (first.worker_id, 42_000)


async def test_lease_down_at_start_fails_quickly(zk_namespace: str, stack: AsyncExitStack) -> None:
    """With nothing listening, a lease claim raises CoordinatorUnavailable within its connect timeout."""
    registry = lease(f"127.0.0.1:{free_port()}", zk_namespace, "10.0.0.1:1", stack, connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable):
        await registry.register()
    assert time.monotonic() - started < 2.0
    assert not registry.can_issue()


async def test_lease_is_timed_by_the_granted_session_timeout(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """The server clamps the session timeout asked for; the lease is timed by its grant, either way."""
    hosts = zookeeper_server.hosts
    longer = lease(hosts, zk_namespace, "10.0.0.1:1", stack, session_timeout=60.0)
    await longer.register()
    assert longer.session_timeout == zookeeper_server.max_session_timeout_ms / 1000
    assert longer.issue_deadline() <= time.monotonic() + longer.session_timeout * 2 / 3
    shorter = lease(hosts, zk_namespace, "10.0.0.2:1", stack, session_timeout=0.2)
    await shorter.register()
    assert shorter.session_timeout == zookeeper_server.min_session_timeout_ms / 1000


async def report_fails_with_lease_lost(registry: ZooKeeperLeaseRegistry, high_water_ms: int) -> None:
    """Report once; pass only if the report raised LeaseLost (anything else is retried by ``eventually``)."""
    try:
        await registry.report(high_water_ms)
    except LeaseLost:
        return
    raise AssertionError("report succeeded; the lease is not seen as lost yet")


async def poll_until(condition: Callable[[], bool], timeout: float) -> float:
    """Wait until ``condition()`` holds; return the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic()


@pytest.mark.slow
async def test_partitioned_holder_stops_before_its_id_can_be_taken(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Cut off from ZooKeeper, a holder stops issuing before its session expires; then another takes the ID."""
    proxy = PartitionProxy(zookeeper_server.port)
    await proxy.start()
    stack.push_async_callback(proxy.close)
    holder = lease(proxy.hosts, zk_namespace, "10.0.0.1:1", stack, max_worker_id=0)
    rival = lease(zookeeper_server.hosts, zk_namespace, "10.0.0.2:1", stack, max_worker_id=0)
    assert (await holder.register()).worker_id == 0
    timeout = holder.session_timeout
    assert timeout == 2.0
    await asyncio.sleep(timeout)  # several keepalives: the lease stays confirmed
    assert holder.can_issue()
    await holder.report(AHEAD + 1_000)
    with pytest.raises(WorkerIdsExhausted):
        await rival.register()

    proxy.partition()
    cut = time.monotonic()
    stopped = await poll_until(lambda: not holder.can_issue(), timeout)
    # The holder gives up no later than 2/3 of the timeout after its last confirmation.
    assert stopped - cut <= timeout * 2 / 3 + 0.2

    async def take_over() -> Any:
        return await rival.register()

    taken = await eventually(take_over, timeout=3 * timeout, interval=0.02, what="the rival's claim")
    claimed = time.monotonic()
    assert taken.worker_id == 0
    assert taken.high_water_ms >= AHEAD + 1_000
    assert not holder.can_issue()
    # The server could only have expired the session a full timeout after the holder's last request,
    # which came before the cut: at least a third of the timeout lies between stopping and the claim.
    assert claimed - stopped >= timeout / 3 - 0.3

    proxy.heal()
    await eventually(lambda: report_fails_with_lease_lost(holder, AHEAD + 1_500), timeout=10)
    assert not holder.can_issue()
    with pytest.raises(WorkerIdsExhausted):
        await holder.register()


async def test_expired_lease_is_claimed_again_with_its_high_water(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """After the session expires, report raises LeaseLost, and register claims afresh with the high water."""
    hosts = zookeeper_server.hosts
    registry = lease(hosts, zk_namespace, "10.0.0.1:1", stack, max_worker_id=3)
    first = await registry.register()
    await registry.report(AHEAD + 2_000)
    session = registry.session.session_id
    assert session is not None
    await expire_session(hosts, session, registry.session.password)

    await eventually(lambda: report_fails_with_lease_lost(registry, AHEAD + 2_100), timeout=10)
    assert not registry.can_issue()
    again = await eventually(registry.register, timeout=10, what="a new lease")
    assert registry.can_issue()
    assert registry.session.session_id != session
    assert again.worker_id == first.worker_id  # it was free again, and the lowest
    assert again.high_water_ms >= AHEAD + 2_100


@pytest.mark.slow
async def test_lease_survives_a_short_zookeeper_restart(
    private_zookeeper: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """ZooKeeper down briefly: can_issue turns false, then true again under the same ID and session."""
    registry = lease(private_zookeeper.hosts, zk_namespace, "10.0.0.1:1", stack, session_timeout=6.0)
    got = await registry.register()
    session = registry.session.session_id
    private_zookeeper.kill()
    await poll_until(lambda: not registry.can_issue(), registry.session_timeout)
    private_zookeeper.start()
    await poll_until(registry.can_issue, 3 * registry.session_timeout)
    assert registry.session.session_id == session
    assert (await registry.register()).worker_id == got.worker_id
