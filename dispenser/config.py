"""Configuration: defaults, overridden by a TOML file, overridden by ``DISPENSER_*`` environment variables.

Every setting ``<section>.<name>`` can be set in the file as ``[section] name = …`` and in the
environment as ``DISPENSER_<SECTION>_<NAME>`` (e.g. ``DISPENSER_NATS_URL``, ``DISPENSER_POSTGRES_DSN``,
``DISPENSER_SEGMENT_FETCH_DEADLINE``). The file is ``--config PATH`` or ``DISPENSER_CONFIG``.
Secrets (passwords, tokens, DSNs) never appear in logs: :func:`redact` masks them.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from dispenser.redaction import redact

Positive = Annotated[float, Meta(gt=0)]
"""Seconds (or another quantity) that must be above zero."""
AtLeastOne = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(ge=0, le=1)]
Port = Annotated[int, Meta(ge=0, le=65535)]
LogLevel = Literal[
    "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "debug", "info", "warning", "error", "critical"
]

__all__ = ["Config", "ConfigError", "effective", "load_config", "redact", "unknown_variables"]


class ConfigError(ValueError):
    """The configuration file or environment holds a value that cannot be used."""


class NatsConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How to reach NATS and which subjects to serve."""

    enabled: bool = True
    """Serve IDs over NATS; false for a Kafka-only worker (which then skips the snowflake peer clock check)."""
    url: str = "nats://127.0.0.1:4222"
    """One or more server URLs, comma-separated."""
    subject_prefix: str = "leaf"
    """Subjects are ``<prefix>.segment.<tag>`` and ``<prefix>.snowflake.<tag>``."""
    queue_group: str = "leaf"
    service_name: str = "leaf-dispenser"
    """The name under which ``$SRV.PING/INFO/STATS`` discovery lists this worker."""
    datacenter: str = ""
    """This worker's datacenter, by name (with NATS gateways: its cluster's gateway name, e.g. ``dc-a``).
    Carried in the rate events and the ``$SRV`` metadata, so that ``dispenser watch`` shows each
    datacenter's subtotal; empty: not said (docs/datacenters.md)."""
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    """A ``.creds`` file (JWT + nkey seed) for decentralised auth."""
    nkeys_seed: str | None = None
    """Path of an nkey seed file."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout: Positive = 5.0
    """Seconds per connection attempt (TCP, TLS and the server's first answer)."""
    start_deadline: Positive = 30.0
    """Seconds ``serve`` and ``enrich`` keep trying to reach NATS at start before exiting 1 (the CLI's
    commands and the clients use their own timeout instead)."""
    ping_interval: AtLeastOne = 2
    """Seconds between pings on an idle connection: with ``max_outstanding_pings``, how soon a server that
    went silent (frozen, partitioned) is noticed and another one is used (nats-py's default: 120)."""
    max_outstanding_pings: AtLeastOne = 2
    """Pings without an answer before the connection counts as dead: noticed within
    ``ping_interval`` x (``max_outstanding_pings`` + 1) seconds."""


class PostgresConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How to reach the segment store."""

    dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    """libpq-style DSN; ``sslmode=verify-full`` etc. work as in libpq."""
    pool_min: AtLeastOne = 1
    pool_max: AtLeastOne = 4
    command_timeout: Positive = 2.0
    """Seconds before a segment fetch counts as failed (and is retried)."""
    connect_timeout: Positive = 5.0
    """Seconds to open a connection; with several hosts in the DSN, each is tried at once under it (docs/ha.md)."""
    new_primary_grace: Annotated[float, Meta(ge=0)] = 2.0
    """After a failover (a primary on a new timeline), seconds to wait before fetching from it, so that every
    live worker has restored the grants it remembers first (``segment.remember_grants``; docs/ha.md)."""


class SegmentConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Segment mode (Leaf-segment)."""

    enabled: bool = True
    # 0: the next segment is fetched at the switch, so a full segment is always in hand (docs/segment.md).
    prefetch_threshold: Fraction = 0.0
    fetch_deadline: Positive = 2.0
    refresh_interval: Positive = 60.0
    retry_max: Positive = 2.0
    remember_grants: bool = True
    """Remember the highest ``max_id`` granted per tag (in memory and in ``state_dir``) and restore it on a
    PostgreSQL primary that lost it, as asynchronous replication can after a failover (docs/ha.md)."""
    state_dir: str | None = None
    """Where ``remember_grants`` keeps its file; default ``snowflake.state_dir``, else
    ``~/.local/state/leaf-dispenser``. Never a temporary directory."""
    return_unused: bool = True
    """On a clean stop, give the unused rest of each tag's segments back to PostgreSQL, handed out again
    before new IDs (docs/segment.md, "Unused IDs returned on a clean stop"); off: it is lost, as in Leaf."""
    residue_check_window: Positive = 0.3
    """Seconds a starting worker (with NATS) listens for the other databases' workers' residue classes
    before serving (docs/datacenters.md); none at all when no other worker listens."""
    residue_recheck_interval: Positive = 10.0
    """Seconds between a worker's checks of its tags' classes against the other databases' workers'."""
    permute_keys_dir: str | None = None
    """A directory of permuted tags' key files, ``<tag>.keys`` (docs/permuted.md), read at start: those tags
    are answered with keyed permutations of their counters; none: no tag is permuted."""


class SnowflakeConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Snowflake mode: layout, worker-ID registry and clock rules."""

    enabled: bool = False
    mode: Literal["static", "zookeeper", "zookeeper-lease", "postgres"] = "static"
    """Where the worker ID comes from (see docs/snowflake.md)."""
    worker_id: int = 0
    """The worker ID in ``static`` mode."""
    name: str = "leaf"
    """Registry namespace: ZooKeeper nodes live under ``<zookeeper_root>/<name>/``."""
    zookeeper_root: Annotated[str, Meta(pattern=r"^(/[^/\s]+)+$")] = "/leaf/snowflake"
    """Parent of the ZooKeeper registry namespaces. Leaf's is ``/snowflake``: with it, ``zookeeper`` mode
    shares Leaf's ``/snowflake/<name>/forever`` nodes (see docs/migrating-from-leaf.md)."""
    address: str | None = None
    """This worker's address in the registry (``zookeeper``/``postgres`` modes key the worker ID by it).
    Unset: ``<host name>:<random>``, made on the first start and kept in ``state_dir``, so that a restart
    gets its worker ID back (see :class:`dispenser.adapters.local.statefile.WorkerIdentity`)."""
    zookeeper_hosts: str = "127.0.0.1:2181"
    zookeeper_session_timeout: float = 10.0
    zookeeper_connect_timeout: float = 5.0
    """Seconds to reach ZooKeeper at start before falling back to the local cache (or refusing)."""
    zookeeper_op_timeout: float = 5.0
    """Seconds one ZooKeeper call may take, waiting for a connection included (a client alone waits for ever)."""
    zookeeper_auth: Annotated[str, Meta(pattern=r"^[^:]+:.")] | None = None
    """Digest credentials ``user:password`` (a secret: never logged). The worker presents them, and the
    registry nodes it creates can then be changed or deleted only with them (see docs/security.md)."""
    zookeeper_world_read: bool = True
    """With ``zookeeper_auth``: let clients without the credentials read the registry nodes (not change them)."""
    state_dir: str | None = None
    """Where the local cache (worker ID, high-water mark) lives; default ``~/.local/state/leaf-dispenser``.
    Never a temporary directory: a reboot must not erase the high-water mark."""
    timestamp_bits: int = 41
    datacenter_bits: int = 0
    """Width of the datacenter field, between the timestamp and the worker ID (Twitter's 5 + 5: set 5 here
    and ``worker_bits = 5``). 0: no such field, Leaf's layout, IDs bit for bit as before."""
    datacenter_id: int = 0
    """This worker's datacenter, ``0 … 2**datacenter_bits - 1``: every datacenter its own (see
    docs/datacenters.md)."""
    worker_bits: int = 10
    sequence_bits: int = 12
    epoch_ms: int = 1288834974657
    """Unix ms of the layout's epoch (Twitter's and Leaf's 2010-11-04 by default)."""
    random_start: int = 100
    """Each millisecond's sequence starts at a random value below this (0 disables)."""
    max_backward_ms: int = 5
    """A run-time clock rollback up to this is waited out (twice the offset); more is an error."""
    report_interval: Positive = 3.0
    """Seconds between high-water reports to the registry and the local cache."""
    peer_threshold_ms: int = 5000
    """Refuse to start when the clock is further than this from the mean of the live peers' clocks."""
    peer_check_timeout: float = 0.3
    """Seconds to collect the live peers' clock readings at start-up."""
    peer_check_failure: Literal["warn", "refuse"] = "warn"
    """When the clock query goes unheard (no permission, no answer): start with a warning, or refuse."""
    peer_recheck_interval: Positive = 10.0
    """Seconds between a serving worker's checks that no live peer claims its (datacenter, worker) ID (two
    workers that started at the same moment, unheard by each other, are found by the next one)."""
    wait_deadline: Positive = 2.0
    """Seconds a request may wait (the next millisecond, a small clock rollback, a recorded mark)."""
    per_process_worker_ids: bool = False
    """In ``static`` mode with ``worker.processes`` above 1: process ``i`` issues under ``worker_id + i`` (reserve
    ``worker_id`` … ``worker_id + processes - 1`` for this host). Off: such a start is refused, since one
    static ID shared by two processes would repeat IDs (docs/operations.md)."""


class KafkaConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How to reach Kafka, and the request/reply topics ``dispenser serve`` answers on when enabled."""

    enabled: bool = False
    """Serve ID requests from :attr:`request_topic` (``dispenser enrich`` uses the connection settings
    whether or not this is set)."""
    bootstrap_servers: str = "127.0.0.1:9092"
    """One or more ``host:port``, comma-separated."""
    client_id: str = "leaf-dispenser"
    request_topic: str = "leaf.requests"
    """Where ID requests arrive (records keyed by tag; body: an ID request plus ``tag`` and ``kind``)."""
    reply_topic: str | None = "leaf.replies"
    """Where replies go when a request has no ``kafka_replyTopic`` header; empty: such requests are
    dropped (logged and counted)."""
    group_id: str = "leaf-dispenser"
    """The consumer group the workers share the request topic's partitions in."""
    request_max_age: float = 60.0
    """Seconds after which a request is no longer answered (its requester has given up): on arrival,
    and while its reply cannot be delivered."""
    reply_timeout: Positive = 1.0
    """Seconds a reply may wait for its topic's metadata (a reply topic that does not exist) before it is
    given up as undeliverable (counted and logged); the worker answers other requests meanwhile."""
    create_topics: bool = True
    """Create the request and default reply topics at start if they are missing."""
    topic_partitions: AtLeastOne = 1
    """Partitions of topics the dispenser creates (more partitions, more workers sharing the load)."""
    replication_factor: AtLeastOne | None = None
    """Replication factor of topics the dispenser creates; unset: the smaller of 3 and the number of brokers
    in the cluster when the topic is created (3 on a cluster of three or more, 1 on a single dev broker)."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    session_timeout_ms: int = 10_000
    """How long a silent consumer keeps its partitions (a crashed worker's requests wait this long)."""
    heartbeat_interval_ms: int = 3_000
    retry_backoff_ms: int = 10
    """aiokafka's default of 100 ms costs every transaction a 100 ms stall on a retried produce."""
    request_timeout_ms: int = 5_000
    """How long a client waits for any one answer from a broker before it drops the connection, refreshes
    its metadata and asks again (aiokafka's default: 40 s; this one's was 30 s). A hung or cut-off broker
    answers nothing, so a flow waits on it a multiple of this (a killed one resets at once). Measured with a
    frozen transaction coordinator: at 30 s the enricher stood still 30.2 s (an earlier run saw neither
    flow resume within 30 s); at 5 s request/reply stood still 2.8-25.0 s and enrichment 5.1-20.2 s
    (``docs/kafka.md``, "A broker that hangs"). Keep it below ``session_timeout_ms``: a heartbeat stuck on
    a frozen group coordinator must time out, and reach the new one, before that coordinator ends the
    member's session. A JoinGroup the broker holds longer (until the other members rejoin, up to the
    session timeout) times out and is sent again: a reconnect, no harm."""


class EnrichConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """``dispenser enrich``: consume, add an ID to every record, produce, exactly once (Kafka transactions)."""

    group_id: str | None = None
    """Consumer group of the enrichers of one stream; default ``leaf-enrich.<input topic>``."""
    transactional_id_prefix: str | None = None
    """Transactional IDs are ``<prefix>.<input partition>``; default: the group ID. Keep it stable:
    it is what fences a zombie enricher after a rebalance or a crash."""
    commit_records: AtLeastOne = 1000
    """Commit a partition's transaction after this many records…"""
    commit_interval: Positive = 0.1
    """…or this many seconds after its first record, whichever comes first."""
    max_record_bytes: AtLeastOne = 1_000_000
    """Records with a larger value go to the dead-letter topic."""
    transaction_timeout_ms: int = 60_000
    """The broker aborts a transaction left open longer than this (e.g. by a crashed enricher)."""
    source_header: bool = True
    """Add ``leaf-source: <topic>/<partition>/<offset>`` (the input record) to every output record."""


class RateConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Consumption-rate events and the adaptive step (see docs/operations.md)."""

    enabled: bool = True
    """Publish a rate event per tag every ``interval`` on ``<nats prefix>.rate.<tag>`` (and ``kafka_topic``
    when Kafka is enabled), and listen to the peers' events."""
    interval: Positive = 5.0
    window: AtLeastOne = 60
    """Seconds averaged for the current rate and for each peak candidate (the peak is the highest
    candidate: the lowest ``window``-second average over ``peak_sustain`` windows)."""
    retention: Positive = 86_400.0
    """Seconds a peak is remembered (and saved in PostgreSQL, so a restart keeps it)."""
    peak_sustain: Annotated[int, Meta(ge=0, le=1440)] = 2
    """Windows over which a peak candidate must hold: IDs drawn within ``peak_sustain - 1`` windows cannot
    raise the peak; 0: each window average is a candidate (the peak is the highest)."""
    adaptive_step: bool = True
    """Size each segment from the rates; false: the tag's configured step, as Leaf."""
    segment_seconds: Positive = 600.0
    """A segment should last this long at this worker's share of the peak demand (Leaf's advice: 600 x peak QPS)."""
    max_step: Annotated[int, Meta(ge=1, le=2**31 - 1)] = 100_000_000
    """The largest step the adaptive rule asks for (the tag's configured step is the smallest)."""
    hysteresis: Fraction = 0.25
    """Keep the current step while the target stays within this fraction of it."""
    stale_after: Positive = 15.0
    """A peer not heard from for this long no longer counts in the fleet."""
    persist_interval: Positive = 60.0
    """Seconds between saves of the peaks to PostgreSQL."""
    kafka_topic: str = "leaf.rate"
    """Kafka topic of the rate events (keyed by tag), when ``kafka.enabled``."""


class MetricsConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Prometheus metrics (``/metrics``)."""

    port: Port | None = None
    """Serve ``/metrics`` on this port; none: off (``dispenser dev`` turns it on at 9464)."""
    host: str = "127.0.0.1"
    status_page: bool = True
    """Serve the status page (``/status``, ``/status.json``) beside ``/metrics``, wherever it is served."""


class HttpCaller(Struct, forbid_unknown_fields=True, kw_only=True):
    """One HTTP caller (``[[http.callers]]``): its token, the tags it may take, its own ID budget."""

    name: str
    """Who it is, for the logs and the errors (never the token)."""
    token_file: str | None = None
    """A file holding the caller's token (a Kubernetes secret); read once at start."""
    token_sha256: str | None = None
    """Or the token's SHA-256, in hex: the config then holds no secret (``printf %s "$TOKEN" | sha256sum``)."""
    tags: list[str] = msgspec.field(default_factory=lambda: ["*"])
    """Tags it may take, as shell patterns (``order``, ``order.*``)."""
    kinds: list[Literal["segment", "snowflake"]] = msgspec.field(
        default_factory=lambda: ["segment", "snowflake"]
    )
    ids_per_second: Positive | None = None
    """Its budget; default ``http.ids_per_second``."""
    ids_burst: Positive | None = None
    """Its burst; default ``http.ids_burst``."""


class HttpConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Leaf's HTTP API (docs/http.md), with ``/metrics``, ``/healthz`` and ``/readyz`` beside it."""

    port: Port | None = None
    """Serve Leaf's HTTP API on this port; none: off. The same port as ``metrics.port``: one server for both."""
    host: str = "127.0.0.1"
    keepalive_timeout: Positive = 75.0
    """Seconds a connection may sit idle, before its first request or between two (nginx's default)."""
    head_timeout: Positive = 10.0
    """Seconds from a request's first byte to the end of its head (request line and headers): a client
    that sends its head byte by byte (slowloris) is cut off then."""
    max_connections: AtLeastOne = 4096
    """Open connections to the API at once; a new one past it is answered 503 (``too_many_connections``) and
    closed. Lowered at start to fit the file-descriptor limit, with room kept for the probes, NATS, Kafka,
    PostgreSQL and the state files (docs/security.md)."""
    ids_per_second: Positive = 10_000_000.0
    """Each HTTP caller's ID budget, sustained (a caller: its ``http.callers`` entry, or its address)."""
    ids_burst: Positive = 100_000_000.0
    """The most IDs a caller may take at once: the budget's bucket. A request over what is left answers
    ``over_budget`` (429, retryable, with ``Retry-After``)."""
    callers: list[HttpCaller] = msgspec.field(default_factory=list)
    """Who may take which IDs over HTTP (``[[http.callers]]``); empty: anyone who can reach the port, as
    Leaf's API. When set, every ID request needs ``Authorization: Bearer <token>`` (docs/security.md)."""


class LimitsConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """What a single request may ask for."""

    max_ids: AtLeastOne = 10_000
    """Largest ``count`` in the ``ids`` format."""
    max_ranges: AtLeastOne = 1_000_000
    """Largest ``count`` in the ``ranges`` format."""
    max_body_bytes: AtLeastOne = 4096
    dedup_ttl: Positive = 60.0
    """Seconds a ``request_id`` is remembered."""
    dedup_store: Literal["auto", "postgres", "local"] = "auto"
    """Where answers to requests with a ``request_id`` are kept: ``postgres`` (fleet-wide: a retry on any
    worker gets the same IDs), ``local`` (this worker only), ``auto`` (``postgres`` when the worker uses
    PostgreSQL anyway — segments on, or snowflake in ``postgres`` mode — else ``local``)."""
    dedup_unsettled: Literal["answer", "refuse"] = "refuse"
    """A request with a ``request_id`` whose answer cannot be recorded in the fleet-wide store before its
    deadline (PostgreSQL down, failing over, or slower than the deadline): ``refuse`` (the default:
    ``unavailable``, retryable; its IDs become a gap), so that every answer given is exact across workers
    (docs/protocol.md), or ``answer`` (from the buffer, idempotent on this worker only: a retry on another
    worker gets other IDs)."""


class LogConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Logging."""

    level: LogLevel = "INFO"
    format: Literal["text", "json"] = "text"


class WorkerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How ``dispenser serve`` runs on this host."""

    processes: AtLeastOne | Literal["auto"] = 1
    """Worker processes under one supervisor (``auto``: the cores this process may use, a container's CPU
    quota included). Above 1 they share the HTTP port (``SO_REUSEPORT``), the NATS queue group and the Kafka
    consumer group; each has its own segments, snowflake worker ID and state (docs/operations.md)."""


class Config(Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration."""

    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    postgres: PostgresConfig = msgspec.field(default_factory=PostgresConfig)
    segment: SegmentConfig = msgspec.field(default_factory=SegmentConfig)
    snowflake: SnowflakeConfig = msgspec.field(default_factory=SnowflakeConfig)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    enrich: EnrichConfig = msgspec.field(default_factory=EnrichConfig)
    rate: RateConfig = msgspec.field(default_factory=RateConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)


_SECTIONS: dict[str, type[Struct]] = {
    "nats": NatsConfig,
    "postgres": PostgresConfig,
    "segment": SegmentConfig,
    "snowflake": SnowflakeConfig,
    "kafka": KafkaConfig,
    "enrich": EnrichConfig,
    "rate": RateConfig,
    "metrics": MetricsConfig,
    "http": HttpConfig,
    "limits": LimitsConfig,
    "log": LogConfig,
    "worker": WorkerConfig,
}


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    for section, cls in _SECTIONS.items():
        for field in cls.__struct_fields__:
            value = environ.get(f"DISPENSER_{section}_{field}".upper())
            if value is not None:
                overrides.setdefault(section, {})[field] = value
    return overrides


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Build the configuration from defaults, the TOML file (if any) and the environment.

    Raises:
        ConfigError: the file is missing or unreadable, or a value is unknown or has the wrong type; the
            message names the file and the setting (``[nats] urll``) or the variable.
    """
    environ = os.environ if environ is None else environ
    path = path or environ.get("DISPENSER_CONFIG")
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    try:
        config = msgspec.convert(raw, Config)
        # Environment values are strings: convert them leniently ("2.5" → 2.5, "true" → True).
    except msgspec.ValidationError as exc:
        where = f"config file {path}" if path else "configuration"
        raise ConfigError(f"{where}: {_explain(exc)}") from exc
    for section, values in _env_overrides(environ).items():
        merged = msgspec.to_builtins(getattr(config, section)) | values
        try:
            setattr(config, section, msgspec.convert(merged, _SECTIONS[section], strict=False))
        except msgspec.ValidationError as exc:
            # msgspec names the field from the section's root ($.level): name the setting instead.
            detail = str(exc).replace("`$.", f"`{section}.")
            names = ", ".join(f"DISPENSER_{section}_{name}".upper() for name in values)
            raise ConfigError(f"invalid configuration ({names}): {detail}") from exc
    return config


_MSGSPEC_PATH = re.compile(r"\s+- at `\$(?P<path>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")


def _explain(exc: msgspec.ValidationError) -> str:
    """A msgspec error about the file's contents, in the file's own terms: ``[nats] urll: unknown setting``."""
    message = str(exc)
    located = _MSGSPEC_PATH.search(message)
    keys = located.group("path").lstrip(".").split(".") if located and located.group("path") else []
    problem = message[: located.start()] if located else message
    unknown = _UNKNOWN_FIELD.match(problem)
    if unknown:
        field = unknown.group("field")
        if not keys:  # a section of its own
            return f"[{field}]: unknown section{_did_you_mean(field, list(_SECTIONS))}"
        cls = _SECTIONS.get(keys[0])
        known = list(cls.__struct_fields__) if cls else []
        return f"[{keys[0]}] {field}: unknown setting{_did_you_mean(field, known)}"
    if len(keys) >= 2:
        return f"[{keys[0]}] {'.'.join(keys[1:])}: {problem}"
    if keys:
        return f"[{keys[0]}]: {problem}"
    return problem


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name.lower(), candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


NON_SETTING_VARIABLES = frozenset(
    {
        "DISPENSER_CONFIG",
        # The test harness and scripts/test (docs/testing.md, docs/development.md).
        "DISPENSER_KAFKA_VERSION",
        "DISPENSER_KAFKA_JARS",
        "DISPENSER_ZOOKEEPER_JARS",
        "DISPENSER_PATRONI_PYTHON",
        "DISPENSER_LIBFAKETIME",
        "DISPENSER_SKIP_STATIC",
        "DISPENSER_TEST_WORKERS",
        "DISPENSER_REINSTALL",
    }
)
"""``DISPENSER_*`` variables that are not settings but are read elsewhere: no warning for them."""


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``DISPENSER_*`` variable that is no setting, naming the closest setting's variable.

    A misspelt variable (``DISPENSER_NATS_URLS``) would otherwise be silently ignored.
    """
    environ = os.environ if environ is None else environ
    known = {
        f"DISPENSER_{section}_{field}".upper()
        for section, cls in _SECTIONS.items()
        for field in cls.__struct_fields__
    }
    lines = []
    for name in sorted(environ):
        if not name.startswith("DISPENSER_") or name in known or name in NON_SETTING_VARIABLES:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a setting and is ignored{hint}")
    return lines


_SECRET_SETTINGS = frozenset(
    {
        ("nats", "password"),
        ("nats", "token"),
        ("kafka", "sasl_password"),
        ("snowflake", "zookeeper_auth"),
    }
)
_URL_SETTINGS = frozenset({("nats", "url"), ("postgres", "dsn")})


def effective(config: Config) -> dict[str, dict[str, Any]]:
    """The configuration as plain data, section by section, with secrets masked (``dispenser config``)."""
    sections: dict[str, dict[str, Any]] = msgspec.to_builtins(config)
    for section, values in sections.items():
        for name, value in values.items():
            if value is None:
                continue
            if (section, name) in _SECRET_SETTINGS:
                values[name] = "***"
            elif (section, name) in _URL_SETTINGS:
                values[name] = redact(str(value))
    return sections
