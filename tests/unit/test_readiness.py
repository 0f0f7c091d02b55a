"""/readyz's rule (dispenser.readiness.not_ready) and the separate "cannot issue" signal (cannot_issue).

Ready: started, NATS up, and every ID source reached once since the start; a dependency lost after that
leaves the worker ready, answering coded retryable errors, and shows in cannot_issue instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dispenser.config import Config, load_config
from dispenser.core.errors import StoreUnavailable, UnknownTag
from dispenser.readiness import cannot_issue, not_ready


@dataclass
class Nats:
    is_connected: bool = True


@dataclass
class Store:
    connected: bool = True


@dataclass
class Buffer:
    remaining: int = 0


@dataclass
class Tag:
    buffer: Buffer = field(default_factory=Buffer)
    last_error: object = None


@dataclass
class Allocator:
    tags: dict[str, Tag] = field(default_factory=dict)


@dataclass
class Snowflake:
    holds_lease: bool = True


@dataclass
class FakeWorker:
    config: Config
    started: bool = True
    serve: bool = True
    nc: Nats | None = field(default_factory=Nats)
    postgres: Store | None = field(default_factory=Store)
    allocator: Allocator | None = field(default_factory=Allocator)
    snowflake: Snowflake | None = None


NATS_DOWN = "NATS is not connected"
NEVER_REACHED = "PostgreSQL has not been reached since the worker started: it has never issued segment IDs"
DRY = "segment: PostgreSQL cannot be reached and no segment IDs are buffered"
LEASE = "snowflake: the worker ID is not held (registering, or the lease was lost)"


def segment_worker(**changes: object) -> FakeWorker:
    worker = FakeWorker(load_config(environ={}))
    for name, value in changes.items():
        setattr(worker, name, value)
    return worker


def test_a_connected_worker_is_ready() -> None:
    """NATS connected and PostgreSQL's pool open: no reason."""
    assert not_ready(segment_worker()) == []


def test_a_worker_starting_or_stopping_is_not_ready() -> None:
    """Before start() ends and from stop() on: one reason, whatever else holds."""
    assert not_ready(segment_worker(started=False)) == ["starting, or stopping"]
    assert not_ready(segment_worker(started=False, nc=None)) == ["starting, or stopping"]


def test_nats_down_or_never_connected_is_not_ready() -> None:
    """A reconnecting or absent NATS connection is a reason (when NATS is on)."""
    assert not_ready(segment_worker(nc=Nats(is_connected=False))) == [NATS_DOWN]
    assert not_ready(segment_worker(nc=None)) == [NATS_DOWN]
    off = load_config(environ={"DISPENSER_NATS_ENABLED": "false"})
    assert not_ready(FakeWorker(off, nc=None)) == []


def test_postgresql_lost_after_the_start_leaves_the_worker_ready_and_says_it_cannot_issue() -> None:
    """Every buffer dry and the store failing: still ready (it answers `unavailable`), and cannot_issue says why.

    Before, such a worker turned unready, and since a PostgreSQL outage reaches every worker at once, every
    pod left the Service together: Leaf's HTTP callers got the load balancer's refusal instead of the coded,
    retryable `unavailable`.
    """
    failing = Tag(Buffer(0), StoreUnavailable("down"))
    dry = segment_worker(allocator=Allocator({"a": failing}))
    assert not_ready(dry) == []
    assert cannot_issue(dry) == [DRY]
    riding = Allocator({"a": failing, "b": Tag(Buffer(500), StoreUnavailable("down"))})
    assert not_ready(segment_worker(allocator=riding)) == []
    assert cannot_issue(segment_worker(allocator=riding)) == []
    # A tag-level error that is not the store's (an unknown tag) says nothing about reaching PostgreSQL.
    unknown = Allocator({"gone": Tag(Buffer(0), UnknownTag("gone"))})
    assert cannot_issue(segment_worker(allocator=unknown)) == []


def test_postgresql_never_reached_since_the_start_is_not_ready() -> None:
    """A lazy start whose pool never opened (a wrong DSN, a new pod in an outage): not ready, so a rollout stops."""
    never = segment_worker(postgres=Store(connected=False))
    assert not_ready(never) == [NEVER_REACHED]
    assert cannot_issue(never) == [DRY]
    assert not_ready(segment_worker(postgres=None)) == [NEVER_REACHED]


def test_snowflake_lease_lost_after_the_start_is_ready_and_cannot_issue() -> None:
    """The worker ID is held at the start (start() waits for it); lost later: ready, `lease_lost` answered."""
    config = load_config(
        environ={"DISPENSER_SEGMENT_ENABLED": "false", "DISPENSER_SNOWFLAKE_ENABLED": "true"}
    )
    assert not_ready(FakeWorker(config, snowflake=Snowflake())) == []
    assert cannot_issue(FakeWorker(config, snowflake=Snowflake())) == []
    lost = FakeWorker(config, snowflake=Snowflake(holds_lease=False))
    assert not_ready(lost) == []
    assert cannot_issue(lost) == [LEASE]
    assert cannot_issue(FakeWorker(config, snowflake=None)) == [LEASE]
    enricher = load_config(environ={})
    assert not_ready(FakeWorker(enricher, serve=False, nc=None)) == []


def test_a_stopping_worker_cannot_issue_either() -> None:
    """From stop() on, both signals say so (no request is taken)."""
    assert cannot_issue(segment_worker(started=False)) == ["starting, or stopping"]
