"""ZooKeeper and Kafka for the integration tests: real Apache servers (jars from Maven Central) on 127.0.0.1.

A server that cannot start (no Java, no Maven, no network for the first fetch) fails the tests that need
it, with the reason and the server's log; nothing is skipped.

Fixtures:
    kafka_broker: one single-node KRaft Kafka for the whole session; don't stop it. Tests keep apart by
        using topics and groups of their own (``kafka_support.unique``).
    private_kafka: a Kafka of the test's own, to stop, kill and restart (same ports and data).
    private_zookeeper: a ZooKeeper of the test's own, to stop, kill and restart (same port and data).
    (``zookeeper_server`` and ``zk_namespace`` are suite-wide, in ``tests/conftest.py``: the contract suites
    use them too.)
    mariadb_server: one MariaDB (Leaf's MySQL) for the whole session; don't stop it. Tests keep apart
        by using a database of their own (``leaf_mysql``).
    private_mariadb: a MariaDB of the test's own, to stop, kill and restart (same port and data).
    leaf_mysql: a database of the test's own on it, holding Leaf's ``leaf_alloc`` with Leaf's DDL.
"""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispenser_lab.servers.kafka import KafkaBroker
from dispenser_lab.servers.mariadb import MariaDBServer
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.conftest import _running, _started
from tests.integration.leaf_support import LEAF_DDL, LeafMySQL


@pytest.fixture
def private_zookeeper(tmp_path: Path) -> Iterator[ZooKeeperServer]:
    """A ZooKeeper for this test alone: stop, kill or restart it (same port and data) as the test needs."""
    yield from _running(ZooKeeperServer(tmp_path / "zookeeper"))


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A Kafka broker shared by the session, on free ports of 127.0.0.1."""
    yield from _running(KafkaBroker(tmp_path_factory.mktemp("kafka")))


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A Kafka broker for this test alone: stop, kill or restart it (same ports and data) as the test needs."""
    yield from _running(KafkaBroker(tmp_path / "kafka"))


@pytest.fixture(scope="session")
def _mariadb_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cleanly stopped, freshly installed data directory that servers copy (~0.1 s) instead of installing one (~5 s)."""
    base = tmp_path_factory.mktemp("mariadb-template")
    _started(MariaDBServer(base)).stop()
    return base / "data"


def _mariadb_from(template: Path, base: Path) -> MariaDBServer:
    # A cold copy of a cleanly stopped server; MariaDBServer gives it to the server's user when it starts.
    shutil.copytree(template, base / "data", symlinks=True)
    return MariaDBServer(base)


@pytest.fixture(scope="session")
def mariadb_server(
    tmp_path_factory: pytest.TempPathFactory, _mariadb_template: Path
) -> Iterator[MariaDBServer]:
    """A MariaDB shared by the session (Debian's mariadb-server), on a free port of 127.0.0.1."""
    yield from _running(_mariadb_from(_mariadb_template, tmp_path_factory.mktemp("mariadb")))


@pytest.fixture
def private_mariadb(tmp_path: Path, _mariadb_template: Path) -> Iterator[MariaDBServer]:
    """A MariaDB for this test alone: stop, kill or restart it (same port and data) as the test needs."""
    yield from _running(_mariadb_from(_mariadb_template, tmp_path / "mariadb"))


_leaf_databases = itertools.count(1)


@pytest.fixture
def leaf_mysql(mariadb_server: MariaDBServer, request: pytest.FixtureRequest) -> Iterator[LeafMySQL]:
    """A database of this test's own holding Leaf's ``leaf_alloc`` (Leaf's DDL, no rows); dropped afterwards."""
    slug = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower()).strip("_")
    name = f"leaf{next(_leaf_databases)}_{slug}"[:64]
    dsn = mariadb_server.create_database(name)
    mariadb_server.sql(LEAF_DDL, database=name)
    yield LeafMySQL(mariadb_server, name, dsn)
    mariadb_server.drop_database(name)
