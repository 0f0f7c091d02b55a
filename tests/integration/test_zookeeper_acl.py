"""Digest credentials and ACLs on a real ZooKeeper: other clients cannot change or delete registrations."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import pytest
from kazoo.exceptions import NoAuthError  # type: ignore[import-untyped]  # kazoo has no type hints
from kazoo.security import OPEN_ACL_UNSAFE, Permissions  # type: ignore[import-untyped]

from dispenser.adapters.zookeeper.lease import ZooKeeperLeaseRegistry
from dispenser.adapters.zookeeper.registry import ZkSession, ZooKeeperRegistry, digest_id
from dispenser.config import ConfigError, load_config
from dispenser.core.errors import CoordinatorUnavailable
from dispenser.ports import SystemClock
from dispenser.registries import layout_of, open_registry
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.integration.zk_support import eventually, off_loop, plain_client
from tests.secret_values import SECRETS

pytestmark = pytest.mark.zookeeper

FAST: dict[str, Any] = {"session_timeout": 2.0, "connect_timeout": 2.0, "op_timeout": 1.0}
AUTH = f"leaf-dispenser:{SECRETS['zookeeper_password']}"
WRONG_AUTH = f"leaf-dispenser:{SECRETS['zookeeper_wrong_password']}"
PASSWORDS = (SECRETS["zookeeper_password"], SECRETS["zookeeper_wrong_password"])


KAZOO_LOG = "dispenser.adapters.zookeeper.session.kazoo"
"""The logger the session gives kazoo (kazoo prints every request sent at DEBUG, the credentials included)."""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(1)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        # The whole line: message, arguments and traceback.
        self.lines.append((record.levelno, logging.Formatter().format(record)))


@contextmanager
def every_log_line() -> Iterator[list[tuple[int, str]]]:
    """Collect every log line at DEBUG, and kazoo's down to its BLATHER level (5: every packet read)."""
    handler = _Records()
    root = logging.getLogger()
    kazoo_log = logging.getLogger(KAZOO_LOG)
    saved = root.level, kazoo_log.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    kazoo_log.setLevel(1)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        kazoo_log.setLevel(saved[1])


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    """Closes every registry and client a test opened, whatever happened."""
    async with AsyncExitStack() as s:
        yield s


async def bare_client(hosts: str, stack: AsyncExitStack) -> Any:
    """A bare kazoo client with no credentials (as any other program on the network could be)."""
    return await stack.enter_async_context(plain_client(hosts))


async def session(hosts: str, auth: str | None, stack: AsyncExitStack) -> ZkSession:
    zk = ZkSession(hosts, auth=auth, **FAST)
    await zk.open()
    stack.push_async_callback(zk.close)
    return zk


def forever(hosts: str, name: str, address: str, stack: AsyncExitStack, **kw: Any) -> ZooKeeperRegistry:
    registry = ZooKeeperRegistry(hosts, name, address, max_worker_id=1023, **{**FAST, **kw})
    stack.push_async_callback(registry.close)
    return registry


def leased(hosts: str, name: str, address: str, stack: AsyncExitStack, **kw: Any) -> ZooKeeperLeaseRegistry:
    registry = ZooKeeperLeaseRegistry(hosts, name, address, max_worker_id=1023, **{**FAST, **kw})
    stack.push_async_callback(registry.close)
    return registry


async def refused(attempt: Any) -> None:
    """The call fails with ZooKeeper's NoAuth (raw kazoo) or our CoordinatorUnavailable saying NoAuth."""
    with pytest.raises((NoAuthError, CoordinatorUnavailable)) as caught:
        await asyncio.wait_for(attempt, 5)
    if isinstance(caught.value, CoordinatorUnavailable):
        assert "NoAuth" in caught.value.message
        assert not any(p in caught.value.message for p in PASSWORDS)


async def test_worker_nodes_refuse_writes_without_the_credentials(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """In zookeeper mode, clients without (or with wrong) credentials read the nodes but cannot change them."""
    hosts = zookeeper_server.hosts
    with every_log_line() as lines:
        worker = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH)
        lease = await worker.register()
        await worker.report(1_900_000_000_000)
    node = f"{worker.forever_path}/10.0.0.1:8080-{lease.worker_id:010d}"
    temporary = f"{worker.temporary_path}/10.0.0.1:8080"

    anyone = await bare_client(hosts, stack)
    data, _ = await off_loop(anyone.get, node)  # world READ (the default)
    assert b"1900000000000" in data
    owner = await session(hosts, AUTH, stack)
    acl = await owner.get_acl(node)
    assert {(a.id.scheme, a.id.id, a.perms) for a in acl} == {
        ("digest", digest_id(AUTH), 31),  # all five permissions
        ("world", "anyone", Permissions.READ),
    }
    # ZooKeeper shows the digest only to those who may change the ACL.
    assert {a.id.id for a in (await off_loop(anyone.get_acls, node))[0]} == {"leaf-dispenser:x", "anyone"}
    for path in (worker.base_path, worker.forever_path, worker.temporary_path, node, temporary):
        await refused(off_loop(anyone.set, path, b"{}"))
        await refused(off_loop(anyone.set_acls, path, OPEN_ACL_UNSAFE))
    await refused(off_loop(anyone.delete, node))
    await refused(off_loop(anyone.delete, temporary))
    await refused(off_loop(anyone.create, f"{worker.forever_path}/10.0.0.9:1-", sequence=True))
    await refused(off_loop(anyone.create, f"{worker.base_path}/lease"))

    wrong = await session(hosts, WRONG_AUTH, stack)
    await refused(wrong.call("overwriting", lambda zk: zk.set_async(node, b"{}")))
    await refused(wrong.call("deleting", lambda zk: zk.delete_async(temporary)))

    data, _ = await off_loop(anyone.get, node)
    assert b"1900000000000" in data  # untouched
    assert await off_loop(anyone.exists, temporary)
    assert lines
    assert not any(p in line for _, line in lines for p in PASSWORDS)
    server_log = zookeeper_server.log_path.read_text(errors="replace")
    assert not any(p in server_log for p in PASSWORDS)
    # The digest (a hash of the password) only in kazoo's packet dump below DEBUG (ACLs read back), which
    # is off unless asked for; its DEBUG request lines print requests by type and path.
    assert any("Sending request" in line for _, line in lines)
    assert not any(digest_id(AUTH) in line for level, line in lines if level >= logging.DEBUG)


async def test_second_worker_with_the_credentials_works_normally(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Two workers with the same credentials register, report and re-register as without ACLs."""
    hosts = zookeeper_server.hosts
    first = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH)
    second = forever(hosts, zk_namespace, "10.0.0.2:8080", stack, auth=AUTH)
    one, two = await first.register(), await second.register()
    assert one.worker_id != two.worker_id
    await second.report(1_900_000_000_000)
    await second.close()
    again = forever(hosts, zk_namespace, "10.0.0.2:8080", stack, auth=AUTH)
    lease = await again.register()
    assert (lease.worker_id, lease.high_water_ms) == (two.worker_id, 1_900_000_000_000)


async def test_worker_without_credentials_cannot_join_a_protected_namespace(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A worker with wrong credentials gets a clear CoordinatorUnavailable, without any password in it."""
    hosts = zookeeper_server.hosts
    await forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH).register()
    for auth in (WRONG_AUTH, None):
        intruder = forever(hosts, zk_namespace, "10.0.0.3:8080", stack, auth=auth)
        with pytest.raises(CoordinatorUnavailable, match="NoAuth") as caught:
            await intruder.register()
        assert "snowflake.zookeeper_auth" in caught.value.message
        assert not any(p in caught.value.message for p in PASSWORDS)
        await intruder.close()


async def test_lease_nodes_refuse_writes_without_the_credentials(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """In zookeeper-lease mode nobody else can free a lease or lower its high water; peers still lease."""
    hosts = zookeeper_server.hosts
    holder = leased(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH)
    lease = await holder.register()
    await holder.report(1_900_000_000_000)
    lease_node = f"{holder.lease_path}/{lease.worker_id}"
    high_water = f"{holder.high_water_path}/{lease.worker_id}"

    anyone = await bare_client(hosts, stack)
    await refused(off_loop(anyone.delete, lease_node))
    await refused(off_loop(anyone.set, high_water, b'{"timestamp": 0}'))
    await refused(off_loop(anyone.delete, high_water))
    await refused(off_loop(anyone.create, f"{holder.lease_path}/{lease.worker_id + 1}", ephemeral=True))
    assert holder.can_issue()

    peer = leased(hosts, zk_namespace, "10.0.0.2:8080", stack, auth=AUTH)
    other = await peer.register()
    assert other.worker_id != lease.worker_id
    await holder.close()  # the lease is released by its own session, as without ACLs
    successor = leased(hosts, zk_namespace, "10.0.0.3:8080", stack, auth=AUTH)
    taken = await successor.register()
    assert (taken.worker_id, taken.high_water_ms) == (lease.worker_id, 1_900_000_000_000)


async def test_credentials_added_later_restrict_the_existing_nodes(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A namespace made without credentials is restricted when its worker restarts with them (both modes)."""
    hosts = zookeeper_server.hosts
    old = forever(hosts, zk_namespace, "10.0.0.1:8080", stack)
    first = await old.register()
    await old.close()
    worker = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH)
    assert (await worker.register()).worker_id == first.worker_id
    old_lease = leased(hosts, f"{zk_namespace}-lease", "10.0.0.1:8080", stack)
    taken = await old_lease.register()
    await old_lease.report(1_900_000_000_000)
    await old_lease.close()
    new_lease = leased(hosts, f"{zk_namespace}-lease", "10.0.0.1:8080", stack, auth=AUTH)
    assert (await new_lease.register()).worker_id == taken.worker_id

    anyone = await bare_client(hosts, stack)
    await refused(off_loop(anyone.delete, f"{worker.forever_path}/10.0.0.1:8080-{first.worker_id:010d}"))
    await refused(off_loop(anyone.create, f"{worker.temporary_path}/10.0.0.9:1"))
    await refused(off_loop(anyone.set, f"{new_lease.high_water_path}/{taken.worker_id}", b"{}"))
    await refused(off_loop(anyone.create, f"{new_lease.lease_path}/{taken.worker_id + 1}", ephemeral=True))


async def test_world_read_off_hides_the_nodes(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """With world_read=False a client without the credentials cannot even read the registrations."""
    hosts = zookeeper_server.hosts
    worker = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH, world_read=False)
    lease = await worker.register()
    anyone = await bare_client(hosts, stack)
    await refused(off_loop(anyone.get, f"{worker.forever_path}/10.0.0.1:8080-{lease.worker_id:010d}"))
    await refused(off_loop(anyone.get_children, worker.forever_path))


async def test_credentials_are_presented_again_after_a_reconnect(
    private_zookeeper: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """ZooKeeper restarted: the session resumes on a new connection, re-authenticates, and reports land."""
    hosts = private_zookeeper.hosts
    worker = forever(hosts, zk_namespace, "10.0.0.1:8080", stack, auth=AUTH, session_timeout=10.0)
    lease = await worker.register()
    session_id = worker.session.session_id
    private_zookeeper.stop()
    private_zookeeper.start()
    await eventually(lambda: worker.report(1_900_000_000_000), timeout=15, what="a report after the restart")
    assert worker.session.session_id == session_id  # same session, new connection
    anyone = await bare_client(hosts, stack)
    data, _ = await off_loop(anyone.get, f"{worker.forever_path}/10.0.0.1:8080-{lease.worker_id:010d}")
    assert b"1900000000000" in data


def test_config_from_the_environment_builds_a_protected_registry() -> None:
    """DISPENSER_SNOWFLAKE_ZOOKEEPER_AUTH reaches the registry; a malformed value is refused without echo."""
    config = load_config(
        environ={"DISPENSER_SNOWFLAKE_ZOOKEEPER_AUTH": AUTH, "DISPENSER_SNOWFLAKE_MODE": "zookeeper"}
    )
    assert config.snowflake.zookeeper_auth == AUTH
    assert config.snowflake.zookeeper_world_read
    registry = open_registry(
        config.snowflake, config.postgres, layout_of(config.snowflake), "10.0.0.1:1", SystemClock()
    )
    assert isinstance(registry, ZooKeeperRegistry)
    assert registry.session.acl[0].id.id == digest_id(AUTH)
    assert not any(p in repr(registry) or p in repr(registry.session) for p in PASSWORDS)

    with pytest.raises(ConfigError) as caught:
        load_config(environ={"DISPENSER_SNOWFLAKE_ZOOKEEPER_AUTH": SECRETS["zookeeper_password"]})
    assert "zookeeper_auth" in str(caught.value).lower()
    assert SECRETS["zookeeper_password"] not in str(caught.value)
