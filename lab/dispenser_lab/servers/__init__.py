"""Real servers for tests and ``dispenser dev``: NATS, PostgreSQL (alone or a Patroni cluster), ZooKeeper, Kafka and MariaDB (Leaf's MySQL) on 127.0.0.1, as subprocesses.

Clusters too: :class:`NatsCluster` (routed NATS servers), :class:`NatsGateways` (a NATS server per
datacenter, joined by gateways), :class:`ZooKeeperEnsemble` and :class:`KafkaCluster`
(KRaft nodes, replication factor 3), whose members are the single servers, each killable and restartable.

Synchronous on purpose (no event loop needed): pytest fixtures and the CLI start them, wait for readiness,
and stop them by the PID they started.
"""

from dispenser_lab.servers.kafka import KafkaBroker, fetch_kafka_jars
from dispenser_lab.servers.kafka_cluster import KafkaCluster
from dispenser_lab.servers.mariadb import MariaDBServer, find_mariadb
from dispenser_lab.servers.nats import NatsServer, find_nats_server
from dispenser_lab.servers.nats_cluster import NatsCluster
from dispenser_lab.servers.nats_gateways import NatsGateways
from dispenser_lab.servers.patroni import PatroniCluster, PatroniNode
from dispenser_lab.servers.postgres import PostgresInstall, PostgresServer, find_postgres_installs
from dispenser_lab.servers.process import (
    DevServerError,
    ServerNotFoundError,
    ServerStartError,
    free_port,
    frozen,
    process_tree,
)
from dispenser_lab.servers.zookeeper import ZooKeeperServer, fetch_zookeeper_jars
from dispenser_lab.servers.zookeeper_ensemble import ZooKeeperEnsemble

__all__ = [
    "DevServerError",
    "KafkaBroker",
    "KafkaCluster",
    "MariaDBServer",
    "NatsCluster",
    "NatsGateways",
    "NatsServer",
    "PatroniCluster",
    "PatroniNode",
    "PostgresInstall",
    "PostgresServer",
    "ServerNotFoundError",
    "ServerStartError",
    "ZooKeeperEnsemble",
    "ZooKeeperServer",
    "fetch_kafka_jars",
    "fetch_zookeeper_jars",
    "find_mariadb",
    "find_nats_server",
    "find_postgres_installs",
    "free_port",
    "frozen",
    "process_tree",
]
