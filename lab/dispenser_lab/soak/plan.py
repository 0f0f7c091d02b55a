"""The soak profiles: which faults, in which order, for how long, and how much load (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "PROFILES",
    "ClockStep",
    "Fault",
    "FreezeLeader",
    "KillLeader",
    "KillWorker",
    "LoseDatacenter",
    "Phase",
    "Profile",
    "Rejoin",
    "RestartServer",
    "RestoreDatacenter",
    "ServerName",
    "StartServer",
    "StopServer",
    "WorkerName",
    "scaled",
]

ServerName = Literal["nats", "postgres", "zookeeper", "kafka"]
"""``kafka`` only in the ``ha`` profiles (the workers then also answer over Kafka)."""
Topology = Literal["single", "ha", "dc"]
"""``single``: one server of each kind. ``ha``: a 3-node NATS cluster, a 3-server ZooKeeper ensemble, a
3-node Patroni cluster (strict synchronous replication, the ensemble as its DCS) and three Kafka brokers.
``dc``: two datacenters, a NATS server each joined by gateways (``dc-a``, ``dc-b``), one PostgreSQL and one
ZooKeeper; the clients connect to ``dc-a`` (see :data:`DATACENTER_OF`)."""
WorkerName = Literal["segment-1", "segment-2", "snowflake"]
"""The three worker processes: two serve segments and snowflake IDs, one only snowflake IDs (under
libfaketime, so its clock can be stepped)."""

WORKERS: tuple[WorkerName, ...] = ("segment-1", "segment-2", "snowflake")
CLOCK_WORKER: WorkerName = "snowflake"
"""The worker that runs under libfaketime."""
DATACENTER_OF: dict[WorkerName, str] = {"segment-1": "dc-a", "snowflake": "dc-a", "segment-2": "dc-b"}
"""Where each worker runs in the ``dc`` topology: ``dc-a`` (the clients' datacenter) has two, ``dc-b`` one."""
LOST_DATACENTER = "dc-a"


@dataclass(frozen=True, slots=True)
class KillWorker:
    """SIGKILL a worker process, wait ``down_s``, start it again (same address, so the same worker ID)."""

    worker: WorkerName
    down_s: float = 1.0

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"kill -9 {self.worker}"


@dataclass(frozen=True, slots=True)
class StopServer:
    """Stop a server (``kill=True``: SIGKILL, a crash) and leave it down."""

    server: ServerName
    kill: bool = False

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"{'kill -9' if self.kill else 'stop'} {self.server}"


@dataclass(frozen=True, slots=True)
class StartServer:
    """Start a stopped server again, on the same port and data."""

    server: ServerName

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"start {self.server}"


@dataclass(frozen=True, slots=True)
class RestartServer:
    """Stop a server, wait ``down_s``, start it again on the same port (clients must reconnect)."""

    server: ServerName
    down_s: float = 1.0

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"restart {self.server}"


@dataclass(frozen=True, slots=True)
class ClockStep:
    """Step the wall clock of :data:`CLOCK_WORKER` by ``delta_ms`` (libfaketime; monotonic untouched)."""

    delta_ms: int

    @property
    def label(self) -> str:
        """What the table shows."""
        sign = "+" if self.delta_ms >= 0 else "-"
        size = abs(self.delta_ms)
        amount = f"{size / 1000:g} s" if size >= 1000 else f"{size} ms"
        return f"clock {sign}{amount}"


@dataclass(frozen=True, slots=True)
class KillLeader:
    """SIGKILL the member of a cluster whose loss costs most (``ha`` only), and leave it down.

    PostgreSQL: the Patroni leader (its Patroni and its postmaster's whole tree): a failover.
    ZooKeeper: the ensemble's leader. NATS: the node with the most client connections.
    Kafka: the leader of the request topic's partition 0.
    """

    server: ServerName

    @property
    def label(self) -> str:
        """What the table shows."""
        role = {"postgres": "primary", "zookeeper": "leader", "nats": "busiest node", "kafka": "leader"}
        return f"kill -9 {self.server} {role[self.server]}"


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Start the members of a cluster that were killed, on their ports and data (``ha`` only)."""

    server: ServerName

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"rejoin {self.server}"


@dataclass(frozen=True, slots=True)
class LoseDatacenter:
    """Every worker of ``dc-a`` lost at once (``dc`` only), and left so until :class:`RestoreDatacenter`.

    SIGKILL, or SIGSTOP (``freeze``: frozen, the server keeps routing to them until it drops their silent
    connections).
    """

    freeze: bool = False

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"{'SIGSTOP' if self.freeze else 'kill -9'} {LOST_DATACENTER}"


@dataclass(frozen=True, slots=True)
class RestoreDatacenter:
    """``dc-a``'s workers back: started again (after a kill) or SIGCONT (after a freeze)."""

    @property
    def label(self) -> str:
        """What the table shows."""
        return f"restore {LOST_DATACENTER}"


@dataclass(frozen=True, slots=True)
class KillEnricher:
    """SIGKILL the ``dispenser enrich`` process mid-transaction, wait ``down_s``, start it again (``ha`` only)."""

    down_s: float = 1.0

    @property
    def label(self) -> str:
        """What the table shows."""
        return "kill -9 enricher"


@dataclass(frozen=True, slots=True)
class FreezeLeader:
    """SIGSTOP the member :class:`KillLeader` would kill for ``hold_s`` seconds, then SIGCONT it (``ha`` only).

    A hang, not a crash: its sockets stay open and nothing answers, so clients notice by their deadlines
    only. PostgreSQL: the Patroni leader's Patroni and postmaster trees (Patroni fails over meanwhile; on
    waking, the old leader is a zombie until its Patroni demotes it). The phase waits until the thawed
    member serves again (PostgreSQL: every node streams).
    """

    server: ServerName
    hold_s: float

    @property
    def label(self) -> str:
        """What the table shows."""
        role = {"postgres": "primary", "zookeeper": "leader", "nats": "busiest", "kafka": "leader"}
        return f"freeze {self.server} {role[self.server]} {self.hold_s:g} s"


Fault = (
    KillWorker
    | StopServer
    | StartServer
    | RestartServer
    | ClockStep
    | KillLeader
    | Rejoin
    | KillEnricher
    | LoseDatacenter
    | RestoreDatacenter
    | FreezeLeader
)


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of the run: its fault is injected when it begins, then the load goes on for ``duration_s``.

    Attributes:
        name: Unique within the profile (the table's first column).
        duration_s: Seconds from the phase's start (the fault's own time included) to the next phase.
        fault: What to do at the start; ``None`` for steady and recovery phases.
        must_be_clean: No timeouts, no error replies and no transport errors allowed (the run has
            recovered by then).
    """

    name: str
    duration_s: float
    fault: Fault | None = None
    must_be_clean: bool = False

    @property
    def fault_label(self) -> str:
        """The fault as the table shows it."""
        return "-" if self.fault is None else self.fault.label


@dataclass(frozen=True, slots=True)
class Profile:
    """A whole soak run.

    Attributes:
        name: ``short``, ``long``, ``ha-short`` or ``ha``.
        phases: In order.
        min_ids: The run fails if the clients received fewer IDs (both kinds together).
        max_extra_s: When the phases are over before ``min_ids``, a last steady phase runs at most this long.
        clients: NATS connections (each its own asyncio client).
        inflight: Requests outstanding per client.
        count_range: IDs per request, drawn uniformly from this inclusive range.
        ranges_share: Share of requests that ask for ``ranges`` (the rest ask for a list of ``ids``).
        snowflake_share: Share of requests for snowflake IDs (the rest ask for segment IDs).
        request_id_share: Share of requests that carry a ``request_id`` (retried with it after a timeout).
        request_timeout_s: Seconds a client waits for one reply.
        tag_step: ``leaf_alloc.step`` of the soak's segment tags (the floor of the adaptive step).
        segment_seconds: ``rate.segment_seconds`` of the workers: kept short, so that a PostgreSQL outage
            of a few seconds drains the buffers and the ``unavailable`` path is exercised too.
    """

    name: str
    phases: tuple[Phase, ...]
    min_ids: int
    max_extra_s: float
    topology: Topology = "single"
    kafka_inflight: int = 0
    """Requests outstanding over Kafka (request/reply through the workers), ``ha`` profiles only."""
    enrich_rate: float = 0.0
    """Input records per second through ``dispenser enrich`` (``soak.enrich``), ``ha`` profiles only."""
    clients: int = 4
    inflight: int = 16
    count_range: tuple[int, int] = (1_000, 10_000)
    ranges_share: float = 0.7
    snowflake_share: float = 0.5
    request_id_share: float = 0.2
    request_timeout_s: float = 3.0
    tag_step: int = 50_000
    segment_seconds: float = 2.0
    segment_tags: tuple[str, ...] = ("soak-a", "soak-b")
    snowflake_tags: tuple[str, ...] = ("soak",)

    @property
    def planned_s(self) -> float:
        """Seconds of load the phases take (without a top-up phase)."""
        return sum(phase.duration_s for phase in self.phases)


def _fault_cycle(scale: float, round_no: int, killed: WorkerName, *, crash: bool) -> list[Phase]:
    """One pass over every fault, each followed by time to recover."""
    suffix = "" if round_no == 1 else f" #{round_no}"

    def s(seconds: float) -> float:
        return round(seconds * scale, 1)

    return [
        Phase(f"kill-worker{suffix}", s(8), KillWorker(killed, down_s=1.0)),
        Phase(f"postgres-down{suffix}", s(8), StopServer("postgres", kill=crash)),
        Phase(f"postgres-up{suffix}", s(6), StartServer("postgres")),
        Phase(f"zookeeper-down{suffix}", s(6), StopServer("zookeeper", kill=crash)),
        Phase(f"zookeeper-up{suffix}", s(6), StartServer("zookeeper")),
        Phase(f"nats-restart{suffix}", s(8), RestartServer("nats", down_s=1.0)),
        Phase(f"clock+1s{suffix}", s(6), ClockStep(1000)),
        Phase(f"clock-10ms{suffix}", s(6), ClockStep(-10)),
    ]


def _short() -> Profile:
    # Every fault once, each phase three quarters of the base length (the suite runs this: ~54 s of load,
    # was ~70 s). Still long enough for each fault to bite: PostgreSQL stays down 6 s, more than the
    # 2-4 s of demand the segment buffers hold at segment_seconds = 2, so the `unavailable` path is taken;
    # phases after a worker kill or a NATS restart last until all three workers answer again anyway.
    phases = [
        Phase("steady", 5),
        *_fault_cycle(0.75, 1, "segment-1", crash=False),
        Phase("recovered", 8, must_be_clean=True),
    ]
    return Profile(name="short", phases=tuple(phases), min_ids=10_000_000, max_extra_s=60)


def _long() -> Profile:
    # Four rounds, three times as long each, killing each worker in turn (the snowflake one, whose clock
    # is stepped, included), with SIGKILL instead of a clean stop for the servers every other round, and a
    # ZooKeeper outage during which a worker is killed (it must start from its local cache).
    phases = [Phase("steady", 20)]
    victims: tuple[WorkerName, ...] = ("segment-1", "snowflake", "segment-2", "segment-1")
    for round_no, victim in enumerate(victims, start=1):
        phases += _fault_cycle(3.0, round_no, victim, crash=round_no % 2 == 0)
        phases.append(Phase(f"settle #{round_no}", 15))
    phases += [
        Phase("zookeeper-down, kill", 10, StopServer("zookeeper")),
        Phase("worker restarts from its cache", 15, KillWorker("segment-2", down_s=1.0)),
        Phase("zookeeper-up, late", 20, StartServer("zookeeper")),
        Phase("recovered", 30, must_be_clean=True),
    ]
    return Profile(name="long", phases=tuple(phases), min_ids=200_000_000, max_extra_s=300)


def _hang_cycle(round_no: int, scale: float) -> list[Phase]:
    """One pass over the clustered hangs: each member frozen, then thawed, with time to recover after.

    Each hold is longer than the time the clients need to give up on the frozen member (PostgreSQL: a
    failover, ~7 s with 6 s ZooKeeper sessions; NATS: two missed 2 s pings; ZooKeeper: an election;
    Kafka: the 3 s broker session and the clients' request timeout), so that the hang is felt as such.
    """
    suffix = "" if round_no == 1 else f" #{round_no}"

    def s(seconds: float) -> float:
        return round(seconds * scale, 1)

    return [
        Phase(f"pg-freeze{suffix}", s(16), FreezeLeader("postgres", hold_s=12.0)),
        Phase(f"nats-freeze{suffix}", s(12), FreezeLeader("nats", hold_s=8.0)),
        Phase(f"zk-freeze{suffix}", s(8), FreezeLeader("zookeeper", hold_s=5.0)),
        Phase(f"kafka-freeze{suffix}", s(12), FreezeLeader("kafka", hold_s=8.0)),
    ]


def _ha_cycle(round_no: int, killed: WorkerName, scale: float) -> list[Phase]:
    """One pass over the clustered faults: each kill is followed by a phase in which the member rejoins."""
    suffix = "" if round_no == 1 else f" #{round_no}"

    def s(seconds: float) -> float:
        return round(seconds * scale, 1)

    return [
        Phase(f"pg-failover{suffix}", s(14), KillLeader("postgres")),
        Phase(f"pg-rejoin{suffix}", s(8), Rejoin("postgres")),
        Phase(f"nats-node-kill{suffix}", s(6), KillLeader("nats")),
        Phase(f"nats-rejoin{suffix}", s(5), Rejoin("nats")),
        Phase(f"zk-leader-kill{suffix}", s(6), KillLeader("zookeeper")),
        Phase(f"zk-rejoin{suffix}", s(5), Rejoin("zookeeper")),
        Phase(f"kafka-broker-kill{suffix}", s(10), KillLeader("kafka")),
        Phase(f"kafka-rejoin{suffix}", s(6), Rejoin("kafka")),
        Phase(f"kill-worker{suffix}", s(8), KillWorker(killed, down_s=1.0)),
        Phase(f"kill-enricher{suffix}", s(8), KillEnricher(down_s=1.0)),
        Phase(f"clock+1s{suffix}", s(5), ClockStep(1000)),
        Phase(f"clock-10ms{suffix}", s(5), ClockStep(-10)),
    ]


def _ha(rounds: int, scale: float, min_ids: int, *, hangs: bool) -> Profile:
    # Hangs (issue 22): only in the `ha` profile run by hand, since they would add ~40 s to CI's soak stage.
    # segment_seconds 20: a failover (~6-10 s with 6 s ZooKeeper sessions) must cost a tag holding IDs
    # nothing, so the buffers hold more than a failover's worth (issue 16, item 4).
    phases = [Phase("steady", round(8 * scale, 1))]
    victims: tuple[WorkerName, ...] = ("segment-1", "segment-2", "snowflake")
    for round_no in range(1, rounds + 1):
        phases += _ha_cycle(round_no, victims[(round_no - 1) % len(victims)], scale)
        if hangs and round_no == 1:  # once: each hang holds its member for seconds
            phases += _hang_cycle(round_no, scale)
    phases.append(Phase("recovered", round(8 * scale, 1), must_be_clean=True))
    return Profile(
        name="ha" if rounds > 1 else "ha-short",
        phases=tuple(phases),
        min_ids=min_ids,
        max_extra_s=120,
        topology="ha",
        kafka_inflight=8,
        enrich_rate=400.0,
        segment_seconds=20.0,
    )


def _dc() -> Profile:
    # dc-a (the clients' datacenter) lost twice, killed then frozen, each time restored: its callers are
    # served by dc-b meanwhile (NATS gateways), and go home after. ~36 s of load.
    phases = [
        Phase("steady", 5),
        Phase("dc-a killed", 6, LoseDatacenter()),
        Phase("dc-a restored", 7, RestoreDatacenter()),
        Phase("dc-a frozen", 6, LoseDatacenter(freeze=True)),
        Phase("dc-a restored #2", 7, RestoreDatacenter()),
        Phase("recovered", 5, must_be_clean=True),
    ]
    return Profile(name="dc", phases=tuple(phases), min_ids=5_000_000, max_extra_s=30, topology="dc")


PROFILES: dict[str, Profile] = {
    "short": _short(),
    "long": _long(),
    "ha-short": _ha(1, 0.5, 10_000_000, hangs=False),
    "ha": _ha(2, 1.0, 100_000_000, hangs=True),
    "dc": _dc(),
}
"""``short``: about 54 s of load (CI); ``long``: about 14 minutes (by hand); ``ha``: every clustered
failover twice and every hang (a member frozen with SIGSTOP) once on the clustered stack (by hand, ~4
minutes of load); ``ha-short``: each failover once (CI); ``dc``: a datacenter lost and restored twice, two
NATS servers joined by gateways (CI, ~36 s of load)."""


def scaled(profile: Profile, factor: float) -> Profile:
    """The profile with every phase ``factor`` times as long and ``factor`` times the IDs (for trying out)."""
    phases = tuple(replace(phase, duration_s=round(phase.duration_s * factor, 1)) for phase in profile.phases)
    return replace(profile, phases=phases, min_ids=int(profile.min_ids * factor))
