"""``dispenser dev --ha``: the clustered stack on this machine, to try failovers by hand.

A 3-node NATS cluster, a 3-server ZooKeeper ensemble (sessions capped at 6 s), a 3-node Patroni cluster
(PostgreSQL with strict synchronous replication, the ensemble as its DCS) and, with ``--kafka``, three
Kafka brokers; then one worker serving segment and snowflake IDs from them. It prints every member's PID
and how to find the leaders, so that a user can ``kill -9`` them and watch the worker carry on. Everything
starts afresh under ``<data dir>/ha`` (cluster ports are free ports, different each run).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path

import msgspec

from dispenser.config import Config
from dispenser_lab.devstack import DEMO_TAG, prepare_demo
from dispenser_lab.servers.kafka_cluster import KafkaCluster
from dispenser_lab.servers.nats_cluster import NatsCluster
from dispenser_lab.servers.patroni import PatroniCluster
from dispenser_lab.servers.zookeeper_ensemble import ZooKeeperEnsemble

__all__ = ["run_dev_ha"]

log = logging.getLogger(__name__)

SESSION_CAP_MS = 6000
"""The ensemble's ``maxSessionTimeout``: a killed PostgreSQL primary is replaced in ~6-10 s, not Patroni's
ttl of 20 s (docs/ha.md)."""


def _banner(
    config: Config, nats: NatsCluster, zk: ZooKeeperEnsemble, pg: PatroniCluster, kafka: KafkaCluster | None
) -> str:
    lines = [
        "",
        "Leaf dispenser is serving on a clustered stack (Ctrl-C stops it and everything it started)",
        "",
        f"  NATS cluster       {nats.url}",
        *(f"    nats-{n}  pid {m.pid}   kill -9 {m.pid}" for n, m in enumerate(nats.members, start=1)),
        f"  ZooKeeper ensemble {zk.hosts}",
        *(
            f"    zk-{n}    pid {m.pid}   leader?  echo srvr | nc 127.0.0.1 {m.port} | grep Mode"
            for n, m in enumerate(zk.members, start=1)
        ),
        f"  PostgreSQL (Patroni, strict synchronous) {pg.dsn}",
        *(
            f"    {node.name}    patroni pid {node.pid}, postgres port {node.port}, "
            f"REST http://127.0.0.1:{node.rest_port}/cluster"
            for node in pg.nodes
        ),
        "    the primary is the node whose /primary answers 200; kill -9 its patroni pid and its postmaster",
        "    (first line of <node>/data/postmaster.pid) for a failover: the worker keeps answering from its",
        "    buffers and fetches from the new primary (`dispenser check` names it).",
    ]
    if kafka is not None:
        lines += [
            f"  Kafka (3 brokers, replication factor 3) {kafka.bootstrap}",
            *(f"    kafka-{n} pid {m.pid}   kill -9 {m.pid}" for n, m in enumerate(kafka.members, start=1)),
        ]
    lines += [
        "",
        "  from another terminal:",
        f"    DISPENSER_NATS_URL={nats.url} dispenser get {DEMO_TAG} 5",
        f"    DISPENSER_POSTGRES_DSN='{pg.dsn}' dispenser check",
        "",
    ]
    return "\n".join(lines)


def run_dev_ha(config: Config, data_dir: Path, *, kafka: bool = False) -> int:
    """Start the clustered servers, prepare the database, serve until Ctrl-C, then stop everything.

    PostgreSQL runs as the ``postgres`` user (Patroni refuses root), so this needs root or that user.

    Raises:
        DevServerError: a server could not start (Java, Maven, Debian's PostgreSQL or python3-venv missing).
    """
    from dispenser.app import run_worker  # noqa: PLC0415
    from dispenser.runner import run_async  # noqa: PLC0415

    root = data_dir.absolute() / "ha"
    shutil.rmtree(
        root, ignore_errors=True
    )  # the clusters' ports are new each run: their old data would not fit
    root.mkdir(parents=True)
    root.chmod(0o755)  # Patroni's nodes run as postgres below it
    nats = NatsCluster(root / "nats")
    zookeeper = ZooKeeperEnsemble(root / "zookeeper", max_session_timeout_ms=SESSION_CAP_MS)
    patroni = PatroniCluster(root / "patroni", zookeeper_hosts=zookeeper.hosts)
    brokers = KafkaCluster(root / "kafka") if kafka else None
    try:
        log.info(
            "starting a NATS cluster, a ZooKeeper ensemble, Patroni%s in %s",
            " and Kafka" if kafka else "",
            root,
        )
        nats.start()
        zookeeper.start()
        patroni.start()
        kafka_config = config.kafka
        if brokers is not None:
            brokers.start()
            kafka_config = msgspec.structs.replace(
                kafka_config, enabled=True, bootstrap_servers=brokers.bootstrap, replication_factor=3
            )
        snowflake = config.snowflake
        if not snowflake.enabled:
            snowflake = msgspec.structs.replace(
                snowflake,
                enabled=True,
                mode="zookeeper",
                zookeeper_hosts=zookeeper.hosts,
                state_dir=str(root / "state"),
            )
        config = msgspec.structs.replace(
            config,
            nats=msgspec.structs.replace(config.nats, url=nats.url),
            postgres=msgspec.structs.replace(config.postgres, dsn=patroni.dsn),
            snowflake=snowflake,
            kafka=kafka_config,
        )
        asyncio.run(prepare_demo(patroni.dsn))
        banner = _banner(config, nats, zookeeper, patroni, brokers)
        return run_async(run_worker(config, on_ready=lambda _worker: print(banner, file=sys.stderr)))
    finally:
        for group in (brokers, patroni, zookeeper, nats):
            if group is not None:
                group.stop()
        log.info("stopped the clustered stack")
