"""The soak's processes: NATS, PostgreSQL and ZooKeeper servers and three workers, and the faults done to them.

Everything listens on 127.0.0.1, on free ports, under one work directory. Servers are
:mod:`dispenser_lab.servers` objects (restartable on the same port and data): one of each, or in the
``ha`` topology a 3-node NATS cluster, a 3-server ZooKeeper ensemble, a 3-node Patroni cluster (strict
synchronous replication, the ensemble as its DCS, sessions capped at 6 s) and three Kafka brokers. Workers are
``python -m dispenser serve`` children (:class:`dispenser_lab.bench.nats_load.Child`). Nothing is signalled
but a process started here, through its own ``Popen`` handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client

from dispenser.adapters.nats.peers import collect_peer_clocks
from dispenser.core.peers import PeerReading
from dispenser_lab.bench.nats_load import Child
from dispenser_lab.servers import NatsGateways, NatsServer, PostgresServer, ZooKeeperServer, frozen
from dispenser_lab.servers.kafka import KafkaBroker
from dispenser_lab.servers.kafka_cluster import KafkaCluster
from dispenser_lab.servers.nats_cluster import NatsCluster
from dispenser_lab.servers.patroni import PatroniCluster, PatroniNode
from dispenser_lab.servers.process import kill_process, sigstop
from dispenser_lab.servers.server import ServerProcess
from dispenser_lab.servers.zookeeper_ensemble import ZooKeeperEnsemble
from dispenser_lab.soak.enrich import enricher_args
from dispenser_lab.soak.faketime import FaketimeClock
from dispenser_lab.soak.plan import (
    CLOCK_WORKER,
    DATACENTER_OF,
    LOST_DATACENTER,
    WORKERS,
    ClockStep,
    Fault,
    FreezeLeader,
    KillEnricher,
    KillLeader,
    KillWorker,
    LoseDatacenter,
    Profile,
    Rejoin,
    RestartServer,
    RestoreDatacenter,
    ServerName,
    StartServer,
    StopServer,
    WorkerName,
)
from dispenser_lab.soak.report import clock_step_seen

__all__ = ["SERVICE_NAME", "SoakCluster", "SoakError"]

log = logging.getLogger(__name__)

SERVICE_NAME = "leaf-dispenser"
"""The workers' NATS micro service name (``$SRV.PING.<name>`` counts them)."""
REGISTRY_NAME = "soak"
"""The snowflake registry namespace in ZooKeeper."""
READY_TIMEOUT_S = 60.0
KAFKA_REQUEST_TOPIC = "leaf.requests"
KAFKA_REPLY_TOPIC = "leaf.replies"
ZOOKEEPER_SESSION_CAP_MS = 6000
"""The ensemble's ``maxSessionTimeout``: Patroni's leader key (and a dead worker's ephemeral node) expires
after 6 s instead of Patroni's ttl of 20 s (HA.md: a failover then takes ~6-7 s)."""


class SoakError(RuntimeError):
    """The soak could not run: a server or worker did not start, or a worker never came back."""


class SoakCluster:
    """Three servers and three workers under ``workdir``.

    Args:
        workdir: Holds the servers' data and logs, the workers' logs and snowflake caches.
        profile: Supplies the tags, their step and the workers' segment sizing.
        libfaketime: ``libfaketime.so.1``, preloaded into :data:`~soak.plan.CLOCK_WORKER`.
    """

    def __init__(self, workdir: Path, profile: Profile, libfaketime: Path) -> None:
        self.workdir = workdir
        self.profile = profile
        self.ha = profile.topology == "ha"
        self.nats: NatsServer | NatsCluster | NatsGateways
        self.dc = profile.topology == "dc"
        self.lost: LoseDatacenter | None = None
        """How ``dc-a`` was lost, until restored (``dc`` topology)."""
        self.zookeeper: ZooKeeperServer | ZooKeeperEnsemble
        self.postgres: PostgresServer | PatroniCluster
        self.kafka: KafkaCluster | None = None
        if self.ha:
            self.nats = NatsCluster(workdir / "nats")
            self.zookeeper = ZooKeeperEnsemble(
                workdir / "zookeeper", max_session_timeout_ms=ZOOKEEPER_SESSION_CAP_MS
            )
            self.postgres = PatroniCluster(workdir / "patroni", zookeeper_hosts=self.zookeeper.hosts)
            self.kafka = KafkaCluster(workdir / "kafka")
        else:
            if self.dc:
                # The servers drop a silent (frozen) client within 1.5 s: ping_interval * (ping_max + 1).
                self.nats = NatsGateways(workdir / "nats", ("dc-a", "dc-b"), ping_interval=0.5, ping_max=2)
            else:
                self.nats = NatsServer(workdir / "nats")
            self.postgres = PostgresServer(workdir / "pgdata")
            self.zookeeper = ZooKeeperServer(workdir / "zookeeper")
        (workdir / "workers").mkdir(parents=True, exist_ok=True)
        self.clock = FaketimeClock(workdir / "workers" / "faketime.rc", libfaketime)
        self.workers: dict[str, Child] = {}
        self.restarts: dict[str, int] = dict.fromkeys(WORKERS, 0)
        self.enricher: Child | None = None
        """``dispenser enrich`` (``ha`` profiles, :mod:`soak.enrich`)."""
        self.enricher_restarts = 0

    @property
    def nats_urls(self) -> list[str]:
        """Every NATS server's URL (one in the single topology).

        In the ``dc`` topology, ``dc-a``'s: the clients'.
        """
        if isinstance(self.nats, NatsGateways):
            return [self.nats.url_of(LOST_DATACENTER)]
        return self.nats.urls if isinstance(self.nats, NatsCluster) else [self.nats.url]

    @property
    def describe(self) -> str:
        """One line naming the servers."""
        kafka = f", Kafka {self.kafka.bootstrap}" if self.kafka is not None else ""
        return (
            f"NATS {','.join(self.nats_urls)}, PostgreSQL {self.postgres.dsn}, "
            f"ZooKeeper {self.zookeeper.hosts}{kafka}"
        )

    # -- servers ---------------------------------------------------------------------------------------

    def server(self, name: ServerName) -> ServerProcess[Any]:
        """The server called ``name`` (single topology only: a cluster's members are faulted one by one)."""
        servers: dict[str, object] = {
            "nats": self.nats,
            "postgres": self.postgres,
            "zookeeper": self.zookeeper,
        }
        server = servers.get(name)
        if not isinstance(server, ServerProcess):
            raise SoakError(f"{name} is a cluster here: stop, start and restart are single-topology faults")
        return server

    def start_servers(self) -> None:
        """Start every server (blocking; the jars and Patroni's venv are fetched if missing).

        In the ``ha`` topology the ensemble comes first: Patroni keeps its leader key in it.
        """
        self.nats.start()
        self.zookeeper.start()
        self.postgres.start()
        if self.kafka is not None:
            self.kafka.start()

    async def prepare_database(self) -> None:
        """Create the schema and the soak's segment tags."""
        from dispenser.adapters.postgres.schema import migrate  # noqa: PLC0415
        from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

        await migrate(self.postgres.dsn)
        async with await PostgresSegmentStore.connect(self.postgres.dsn) as store:
            for tag in self.profile.segment_tags:
                await store.add_tag(tag, self.profile.tag_step, description="scripts/soak")

    # -- workers ---------------------------------------------------------------------------------------

    def _worker_env(self, name: WorkerName, index: int) -> dict[str, str]:
        # The user's own DISPENSER_* settings (a config file, another NATS) must not leak into the soak.
        env = {key: value for key, value in os.environ.items() if not key.startswith("DISPENSER_")}
        if isinstance(self.nats, NatsGateways):
            env |= {
                "DISPENSER_NATS_URL": self.nats.url_of(DATACENTER_OF[name]),
                "DISPENSER_NATS_DATACENTER": DATACENTER_OF[name],
            }
        else:
            env["DISPENSER_NATS_URL"] = ",".join(self.nats_urls)
        env |= {
            "DISPENSER_POSTGRES_DSN": self.postgres.dsn,
            "DISPENSER_SEGMENT_ENABLED": "false" if name == CLOCK_WORKER else "true",
            "DISPENSER_SNOWFLAKE_ENABLED": "true",
            "DISPENSER_SNOWFLAKE_MODE": "zookeeper",
            "DISPENSER_SNOWFLAKE_NAME": REGISTRY_NAME,
            "DISPENSER_SNOWFLAKE_ZOOKEEPER_HOSTS": self.zookeeper.hosts,
            # A stable address per worker: a restarted worker gets its worker ID (and high-water mark) back.
            "DISPENSER_SNOWFLAKE_ADDRESS": f"127.0.0.1:{7001 + index}",
            "DISPENSER_SNOWFLAKE_STATE_DIR": str(self.workdir / "workers" / f"{name}-state"),
            "DISPENSER_RATE_SEGMENT_SECONDS": str(self.profile.segment_seconds),
            "DISPENSER_LOG_LEVEL": "INFO",
        }
        if self.kafka is not None and name != CLOCK_WORKER:
            env |= {
                "DISPENSER_KAFKA_ENABLED": "true",
                "DISPENSER_KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap,
                "DISPENSER_KAFKA_REQUEST_TOPIC": KAFKA_REQUEST_TOPIC,
                "DISPENSER_KAFKA_REPLY_TOPIC": KAFKA_REPLY_TOPIC,
                "DISPENSER_KAFKA_REPLICATION_FACTOR": "3",
            }
        if name == CLOCK_WORKER:
            env |= self.clock.env()
        return env

    def start_workers(self) -> None:
        """Start the three workers (not waiting for them; see :meth:`wait_workers`)."""
        for index, name in enumerate(WORKERS):
            child = Child(
                f"worker {name}",
                [sys.executable, "-m", "dispenser", "serve"],
                self.workdir / "workers" / f"{name}.log",
                self._worker_env(name, index),
            )
            self.workers[name] = child
            child.start()

    def start_enricher(self) -> None:
        """Start ``dispenser enrich`` on the soak's stream (the Kafka topologies only)."""
        if self.kafka is None:
            raise SoakError("the enricher needs Kafka: an ha profile")
        env = {key: value for key, value in os.environ.items() if not key.startswith("DISPENSER_")}
        env |= {
            "DISPENSER_NATS_ENABLED": "false",
            "DISPENSER_POSTGRES_DSN": self.postgres.dsn,
            "DISPENSER_KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap,
            # A killed enricher's partitions go to its successor once the group gives up on it.
            "DISPENSER_KAFKA_SESSION_TIMEOUT_MS": "3000",
            "DISPENSER_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
            "DISPENSER_RATE_SEGMENT_SECONDS": str(self.profile.segment_seconds),
            "DISPENSER_LOG_LEVEL": "INFO",
        }
        if self.enricher is None:
            self.enricher = Child(
                "enricher",
                [sys.executable, "-m", "dispenser", "enrich", *enricher_args()],
                self.workdir / "workers" / "enricher.log",
                env,
            )
        self.enricher.start()

    def dead_workers(self) -> dict[str, int | None]:
        """Workers whose process has exited, with the exit status."""
        return {
            name: child.proc.returncode if child.proc is not None else None
            for name, child in self.workers.items()
            if child.exited
        }

    async def wait_workers(self, nc: Client, timeout: float = READY_TIMEOUT_S) -> float:
        """Wait until all three workers answer ``$SRV.PING``; return the seconds it took.

        Raises:
            SoakError: a worker exited, or they were not all there in time.
        """
        began = time.monotonic()
        seen = 0
        while time.monotonic() - began < timeout:
            dead = self.dead_workers()
            if dead:
                name = next(iter(dead))
                raise SoakError(
                    f"worker {name} exited with status {dead[name]}:\n{self.workers[name].tail()}"
                )
            seen = await count_workers(nc)
            if seen >= len(WORKERS):
                return time.monotonic() - began
            await asyncio.sleep(0.2)
        raise SoakError(f"only {seen} of {len(WORKERS)} workers answer $SRV.PING after {timeout:g} s")

    def dump_stacks(self) -> None:
        """Ask every running worker for its threads' stacks (SIGUSR1: they go to the worker's log)."""
        for child in self.workers.values():
            if child.proc is not None and not child.exited:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGUSR1)

    def stop_all(self) -> dict[str, int | None]:
        """Stop the workers (SIGTERM, then SIGKILL), then the servers; return the workers' exit statuses."""
        if self.lost is not None and self.lost.freeze:  # frozen workers cannot take a SIGTERM
            for name in self._lost_workers():
                proc = self.workers[name].proc
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGCONT)
        statuses = {name: child.stop(timeout=10.0) for name, child in self.workers.items()}
        if self.enricher is not None:
            statuses["enricher"] = self.enricher.stop(timeout=20.0)
        for server in (self.kafka, self.postgres, self.zookeeper, self.nats):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        return statuses

    # -- faults ----------------------------------------------------------------------------------------

    async def inject(self, fault: Fault, nc: Client) -> dict[str, Any]:
        """Do ``fault``; return what happened (seconds taken, and a background task's recovery figures).

        Blocking server starts and stops run in a thread, so the load goes on meanwhile.
        """
        began = time.monotonic()
        notes: dict[str, Any] = {}
        match fault:
            case KillWorker(worker=worker, down_s=down_s):
                await self._kill_worker(worker, down_s)
                notes["recovery"] = asyncio.create_task(self._recovered(nc, began))
            case StopServer(server=name, kill=kill):
                server = self.server(name)
                await asyncio.to_thread(server.kill if kill else server.stop)
            case StartServer(server=name):
                await asyncio.to_thread(self.server(name).start)
            case RestartServer(server=name, down_s=down_s):
                server = self.server(name)
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(down_s)
                await asyncio.to_thread(server.start)
                notes["recovery"] = asyncio.create_task(self._recovered(nc, began))
            case LoseDatacenter():
                await self._lose_datacenter(fault)
                notes["served_again_s"] = await _served_again(nc, began)
            case RestoreDatacenter():
                self._restore_datacenter()
                notes["recovery"] = asyncio.create_task(self._recovered(nc, began))
            case KillEnricher(down_s=down_s):
                await self._kill_enricher(down_s)
            case KillLeader(server=name):
                notes |= await self._kill_leader(name, nc, began)
            case FreezeLeader(server=name, hold_s=hold_s):
                notes |= await self._freeze_leader(name, hold_s, nc, began)
            case Rejoin(server=name):
                notes["rejoined_s"] = await asyncio.to_thread(self._rejoin, name)
            case ClockStep(delta_ms=delta_ms):
                self.clock.step(delta_ms)
                notes["clock_offset_ms"] = self.clock.offset_ms
                notes["clock_seen_ms"] = await self._await_step(nc, self.clock.offset_ms)
        notes["action_s"] = round(time.monotonic() - began, 3)
        return notes

    async def _kill_worker(self, worker: WorkerName, down_s: float) -> None:
        """SIGKILL ``worker``, leave it down ``down_s`` s, start it again."""
        child = self.workers[worker]
        if child.proc is not None:
            await asyncio.to_thread(kill_process, child.proc)
        await asyncio.sleep(down_s)
        child.start()
        self.restarts[worker] += 1

    async def _lose_datacenter(self, fault: LoseDatacenter) -> None:
        """Freeze (SIGSTOP) or kill the lost datacenter's workers."""
        for lost in self._lost_workers():
            child = self.workers[lost]
            if child.proc is None:
                continue
            if fault.freeze:
                sigstop(child.proc.pid)
            else:
                await asyncio.to_thread(kill_process, child.proc)
        self.lost = fault

    def _restore_datacenter(self) -> None:
        """Thaw the lost datacenter's workers (SIGCONT), or start them again if they were killed."""
        for lost in self._lost_workers():
            child = self.workers[lost]
            if self.lost is not None and self.lost.freeze and child.proc is not None:
                child.proc.send_signal(signal.SIGCONT)
            else:
                child.start()
                self.restarts[lost] += 1
        self.lost = None

    async def _kill_enricher(self, down_s: float) -> None:
        """SIGKILL the enricher, leave it down ``down_s`` s, start it again."""
        if self.enricher is not None and self.enricher.proc is not None:
            await asyncio.to_thread(kill_process, self.enricher.proc)
        await asyncio.sleep(down_s)
        self.start_enricher()
        self.enricher_restarts += 1

    def _lost_workers(self) -> list[WorkerName]:
        if not self.dc:
            raise SoakError("losing a datacenter needs the dc topology")
        return [name for name in WORKERS if DATACENTER_OF[name] == LOST_DATACENTER]

    async def _kill_leader(self, name: ServerName, nc: Client, began: float) -> dict[str, Any]:
        """SIGKILL the member of the ``name`` cluster whose loss costs most; figures of the failover.

        ``failover_s``: seconds until the cluster has a new leader (PostgreSQL: a writable primary; ZooKeeper:
        an elected leader; Kafka: a new leader of the request partition); for NATS, ``recovery``: seconds
        until every worker answers ``$SRV.PING`` again.
        """
        notes: dict[str, Any] = {}
        if name == "postgres" and isinstance(self.postgres, PatroniCluster):
            patroni = self.postgres
            killed: PatroniNode = await asyncio.to_thread(patroni.kill_leader)
            notes["killed"] = killed.name
            new = await asyncio.to_thread(patroni.wait_leader, other_than=killed, timeout=90.0)
            notes["failover_s"] = round(time.monotonic() - began, 2)
            notes["new_leader"] = new.name
        elif name == "zookeeper" and isinstance(self.zookeeper, ZooKeeperEnsemble):
            ensemble = self.zookeeper
            zk_leader = await asyncio.to_thread(ensemble.leader)
            await asyncio.to_thread(zk_leader.kill)
            notes["killed"] = zk_leader.hosts
            await asyncio.to_thread(ensemble.leader, 60.0)
            notes["failover_s"] = round(time.monotonic() - began, 2)
        elif name == "nats" and isinstance(self.nats, NatsCluster):
            member = await asyncio.to_thread(_busiest, self.nats)
            await asyncio.to_thread(member.kill)
            notes["killed"] = member.url
            notes["recovery"] = asyncio.create_task(self._recovered(nc, began))
        elif name == "kafka" and self.kafka is not None:
            kafka = self.kafka
            victim: KafkaBroker = await asyncio.to_thread(kafka.leader_of, KAFKA_REQUEST_TOPIC, 0)
            await asyncio.to_thread(victim.kill)
            notes["killed"] = victim.bootstrap
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                now_leading = await asyncio.to_thread(_leader_or_none, kafka, KAFKA_REQUEST_TOPIC)
                if now_leading is not None and now_leading is not victim:
                    notes["failover_s"] = round(time.monotonic() - began, 2)
                    break
                await asyncio.sleep(0.1)
            else:
                notes["failover_s"] = "no new leader within 60 s"
        else:
            raise SoakError(f"kill -9 of the {name} leader needs the ha topology")
        return notes

    async def _freeze_leader(
        self, name: ServerName, hold_s: float, nc: Client, began: float
    ) -> dict[str, Any]:
        """SIGSTOP the member :meth:`_kill_leader` would kill, for ``hold_s`` s; SIGCONT; figures of the hang.

        ``failover_s`` (PostgreSQL, ZooKeeper, Kafka): seconds until another member leads, asked of the
        others only (the frozen one would not answer); ``thawed_s``: seconds after the thaw until the
        cluster is whole again (PostgreSQL: the woken zombie demoted and every node streaming; NATS: every
        worker answering ``$SRV.PING``).
        """
        if name == "postgres" and isinstance(self.postgres, PatroniCluster):
            return await _freeze_patroni_leader(self.postgres, hold_s, began)
        if name == "zookeeper" and isinstance(self.zookeeper, ZooKeeperEnsemble):
            return await _freeze_zookeeper_leader(self.zookeeper, hold_s, began)
        if name == "kafka" and self.kafka is not None:
            return await _freeze_kafka_leader(self.kafka, hold_s, began)
        if name == "nats" and isinstance(self.nats, NatsCluster):
            nats_member = await asyncio.to_thread(_busiest, self.nats)
            nats_member.freeze()
            try:
                await asyncio.sleep(hold_s)
            finally:
                nats_member.thaw()
            return {"frozen": nats_member.url, "recovery": asyncio.create_task(self._recovered(nc, began))}
        raise SoakError(f"freezing the {name} leader needs the ha topology")

    def _rejoin(self, name: ServerName) -> float:
        """Start the killed members of the ``name`` cluster again; seconds until it is whole."""
        began = time.monotonic()
        if name == "postgres" and isinstance(self.postgres, PatroniCluster):
            for node in self.postgres.nodes:
                if not node.running:
                    node.start()
            self.postgres.wait_healthy(timeout=120.0)
        elif name == "zookeeper" and isinstance(self.zookeeper, ZooKeeperEnsemble):
            self.zookeeper.start()
        elif name == "nats" and isinstance(self.nats, NatsCluster):
            self.nats.start()
        elif name == "kafka" and self.kafka is not None:
            self.kafka.start()
            self.kafka.wait_in_sync([KAFKA_REQUEST_TOPIC, KAFKA_REPLY_TOPIC], timeout=60.0)
        else:
            raise SoakError(f"rejoining {name} needs the ha topology")
        return round(time.monotonic() - began, 2)

    async def _await_step(self, nc: Client, offset_ms: int, limit_s: float = 5.0) -> dict[str, int]:
        """The workers' clock offsets once the step shows (libfaketime applies it within its cache time)."""
        deadline = time.monotonic() + limit_s
        while True:
            seen = await self.clock_offsets(nc)
            if clock_step_seen(offset_ms, list(seen.values())) or time.monotonic() > deadline:
                return seen

    async def clock_offsets(self, nc: Client, queries: int = 5) -> dict[str, int]:
        """Each snowflake worker's wall clock minus ours in ms, by worker ID, from the peer clock query.

        Proof that a clock step took effect: the stepped worker should be off by the offset written.
        Each worker answers every query; its reading with the shortest round trip counts, since the
        load keeps both event loops busy and a slow answer would blur the estimate.
        """
        best: dict[int, PeerReading] = {}
        for _ in range(queries):
            heard = await collect_peer_clocks(nc, "leaf.snowflake-clock", _now_ms, 0.3, enough=len(WORKERS))
            for reading in heard.readings:
                held = best.get(reading.worker_id)
                if held is None or reading.round_trip_ms < held.round_trip_ms:
                    best[reading.worker_id] = reading
            await asyncio.sleep(0.05)
        return {str(worker_id): round(reading.offset_ms) for worker_id, reading in sorted(best.items())}

    async def _recovered(self, nc: Client, began: float) -> float:
        """Seconds from ``began`` until all workers answer ``$SRV.PING`` again."""
        await self.wait_workers(nc)
        return round(time.monotonic() - began, 3)


async def _served_again(nc: Client, began: float, limit_s: float = 30.0) -> float | str:
    """Seconds from ``began`` until a request from ``nc`` (in the lost datacenter) is answered.

    By the other datacenter's workers, across the gateway. Each try waits 0.25 s (a frozen worker never
    answers).
    """
    while time.monotonic() - began < limit_s:
        try:
            await nc.request("leaf.segment.soak-a", b'{"count": 1}', timeout=0.25)
        except Exception:  # a timeout (routed to a frozen worker), or no responders for a moment
            await asyncio.sleep(0.05)
            continue
        return round(time.monotonic() - began, 3)
    return f"not served within {limit_s:g} s"


def _busiest(cluster: NatsCluster) -> NatsServer:
    """The member with the most client connections (from its monitoring endpoint's ``/varz``)."""

    def connections(port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=1.0) as answer:
                return int(json.load(answer).get("connections", 0))
        except OSError:
            return -1

    counts = [connections(port) for port in cluster.monitor_ports]
    return cluster.member(counts.index(max(counts)) + 1)


async def _freeze_patroni_leader(patroni: PatroniCluster, hold_s: float, began: float) -> dict[str, Any]:
    """:meth:`SoakCluster._freeze_leader` of PostgreSQL: the leader and its postmaster, frozen together."""
    notes: dict[str, Any] = {}
    node = await asyncio.to_thread(patroni.leader)
    postmaster = node.postmaster() if node is not None else None
    if node is None or node.pid is None or postmaster is None:
        raise SoakError("no PostgreSQL leader to freeze")
    notes["frozen"] = node.name
    with frozen(node.pid, postmaster[0]):
        new = await asyncio.to_thread(_writable_leader_other_than, patroni, node, hold_s)
        if new is not None:
            notes["failover_s"] = round(time.monotonic() - began, 2)
        await asyncio.sleep(max(0.0, began + hold_s - time.monotonic()))
    thawed = time.monotonic()
    await asyncio.to_thread(patroni.wait_healthy, 120.0)
    notes["thawed_s"] = round(time.monotonic() - thawed, 2)
    return notes


async def _freeze_zookeeper_leader(
    ensemble: ZooKeeperEnsemble, hold_s: float, began: float
) -> dict[str, Any]:
    """:meth:`SoakCluster._freeze_leader` of ZooKeeper."""
    notes: dict[str, Any] = {}
    member = await asyncio.to_thread(ensemble.leader)
    notes["frozen"] = member.hosts
    member.freeze()
    try:
        await asyncio.to_thread(_zk_leader_other_than, ensemble, member, hold_s)
        notes["failover_s"] = round(time.monotonic() - began, 2)
        await asyncio.sleep(max(0.0, began + hold_s - time.monotonic()))
    finally:
        member.thaw()
    thawed = time.monotonic()
    await asyncio.to_thread(_zk_settled, ensemble, 60.0)
    notes["thawed_s"] = round(time.monotonic() - thawed, 2)
    return notes


async def _freeze_kafka_leader(kafka: KafkaCluster, hold_s: float, began: float) -> dict[str, Any]:
    """:meth:`SoakCluster._freeze_leader` of Kafka: the request partition's leader."""
    notes: dict[str, Any] = {}
    deadline = began + hold_s
    victim: KafkaBroker = await asyncio.to_thread(kafka.leader_of, KAFKA_REQUEST_TOPIC, 0)
    notes["frozen"] = victim.bootstrap
    victim.freeze()
    try:
        while time.monotonic() < deadline:
            leading = await asyncio.to_thread(_leader_or_none, kafka, KAFKA_REQUEST_TOPIC)
            if leading is not None and leading is not victim:
                notes["failover_s"] = round(time.monotonic() - began, 2)
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        victim.thaw()
    thawed = time.monotonic()
    await asyncio.to_thread(kafka.wait_in_sync, [KAFKA_REQUEST_TOPIC, KAFKA_REPLY_TOPIC], timeout=60.0)
    notes["thawed_s"] = round(time.monotonic() - thawed, 2)
    return notes


def _writable_leader_other_than(
    cluster: PatroniCluster, old: PatroniNode, timeout: float
) -> PatroniNode | None:
    """The node other than ``old`` that leads with a writable PostgreSQL, once one does (None: not within ``timeout``).

    ``old`` is not asked: it is frozen and would not answer.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node is old or not node.running:
                continue
            if node.api("/primary")[0] == 200 and node.sql("SELECT pg_is_in_recovery()") == "f":
                return node
        time.sleep(0.1)
    return None


def _zk_leader_other_than(ensemble: ZooKeeperEnsemble, old: ZooKeeperServer, timeout: float) -> None:
    """Wait up to ``timeout`` s until a member other than ``old`` leads."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m is not old and m.mode(timeout=0.5) == "leader" for m in ensemble.members):
            return
        time.sleep(0.1)


def _zk_settled(ensemble: ZooKeeperEnsemble, timeout: float) -> None:
    """Wait until every member answers and exactly one leads (a thawed old leader has rejoined)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        modes = list(ensemble.modes().values())
        if None not in modes and modes.count("leader") == 1:
            return
        time.sleep(0.1)
    raise SoakError(f"the ZooKeeper ensemble did not settle within {timeout:g} s: {ensemble.modes()}")


def _leader_or_none(kafka: KafkaCluster, topic: str) -> KafkaBroker | None:
    """The partition's leader now, or None while there is none (an election, no member answering)."""
    try:
        return kafka.leader_of(topic, 0, timeout=0.5)
    except Exception:  # no leader yet, or the member asked was the one killed
        return None


_ping_decoder = msgspec.json.Decoder(dict[str, Any])


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def count_workers(nc: Client, wait: float = 0.3) -> int:
    """How many distinct workers answer ``$SRV.PING.<service>`` within ``wait`` seconds."""
    inbox = nc.new_inbox()
    ids: set[str] = set()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(f"$SRV.PING.{SERVICE_NAME}", b"", reply=inbox)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # nats-py's timeout, or a reconnect: either way, no more answers
                break
            with contextlib.suppress(msgspec.DecodeError):
                ids.add(str(_ping_decoder.decode(msg.data).get("id")))
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return len(ids)
