"""Clustered NATS, ZooKeeper and Kafka for the high-availability tests, shared by the session.

Each cluster is started once (its members are the single dev servers, see :mod:`dispenser_lab.servers`)
and every test that kills a member restarts it before it ends (:func:`restored`), so the next test finds
the whole cluster again. Tests keep apart by subject prefixes, registry names, topics and groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from dispenser_lab.faultproxy import ThreadedFaultProxy
from dispenser_lab.servers import DevServerError, KafkaCluster, NatsCluster, ZooKeeperEnsemble
from dispenser_lab.servers.group import ServerGroup

__all__ = ["kafka_cluster", "kafka_proxies", "nats_cluster", "restored", "zk_ensemble"]

_Group = TypeVar("_Group", bound=ServerGroup[Any])


def _running(group: _Group) -> Iterator[_Group]:
    try:
        group.start()
    except DevServerError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)
    try:
        yield group
    finally:
        group.stop()


@contextlib.contextmanager
def restored(group: ServerGroup[Any]) -> Iterator[None]:
    """Whatever the test kills inside, every member runs again afterwards (also when the test fails)."""
    try:
        yield
    finally:
        group.start()


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three routed NATS servers on 127.0.0.1."""
    yield from _running(NatsCluster(tmp_path_factory.mktemp("nats-cluster")))


@pytest.fixture(scope="session")
def zk_ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperEnsemble]:
    """Three ZooKeeper servers in one ensemble (tickTime 1 s, sessions of 2-40 s)."""
    yield from _running(ZooKeeperEnsemble(tmp_path_factory.mktemp("zk-ensemble")))


@pytest.fixture(scope="session")
def kafka_proxies() -> Iterator[list[ThreadedFaultProxy]]:
    """A fault proxy per member of ``kafka_cluster``, in the members' order (healed by each test that cuts one).

    Each runs on a thread of its own, listening before the cluster starts, since the brokers advertise
    their ports; clients that bootstrap from ``kafka_cluster.proxied_bootstrap`` go through them.
    """
    with contextlib.ExitStack() as stack:
        # The upstream is each broker's proxied listener, known once the cluster is made (kafka_cluster).
        yield [stack.enter_context(ThreadedFaultProxy(("127.0.0.1", 0))) for _ in range(3)]


@pytest.fixture(scope="session")
def kafka_cluster(
    tmp_path_factory: pytest.TempPathFactory, kafka_proxies: list[ThreadedFaultProxy]
) -> Iterator[KafkaCluster]:
    """Three KRaft Kafka nodes (replication factor 3, min.insync.replicas 2, 3 s broker sessions).

    Clients reach them directly (``bootstrap``) or through ``kafka_proxies`` (``proxied_bootstrap``).
    """
    cluster = KafkaCluster(
        tmp_path_factory.mktemp("kafka-cluster"), proxied_at=[proxy.port for proxy in kafka_proxies]
    )
    for running in _running(cluster):
        # The proxied listeners' ports are final once the members have started (picked again until then).
        for proxy, member in zip(kafka_proxies, cluster.members, strict=True):
            assert member.proxied_port is not None
            proxy.proxy.upstream = ("127.0.0.1", member.proxied_port)
        yield running
