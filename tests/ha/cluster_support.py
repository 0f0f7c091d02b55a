"""Clustered NATS, ZooKeeper and Kafka for the high-availability tests, shared by the session.

Each cluster is started once (its members are the single dev servers, see :mod:`dispenser.testing.servers`)
and every test that kills a member restarts it before it ends (:func:`restored`), so the next test finds
the whole cluster again. Tests keep apart by subject prefixes, registry names, topics and groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from dispenser.testing.servers import DevServerError, KafkaCluster, NatsCluster, ZooKeeperEnsemble
from dispenser.testing.servers.group import ServerGroup

__all__ = ["kafka_cluster", "nats_cluster", "restored", "zk_ensemble"]

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
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """Three KRaft Kafka nodes (replication factor 3, min.insync.replicas 2, 3 s broker sessions)."""
    yield from _running(KafkaCluster(tmp_path_factory.mktemp("kafka-cluster")))
