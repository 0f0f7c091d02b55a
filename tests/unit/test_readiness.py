"""/readyz's rule (dispenser.readiness.not_ready): NATS up, and a store or buffered IDs to serve from."""

from __future__ import annotations

from dataclasses import dataclass, field

from dispenser.config import Config, load_config
from dispenser.core.errors import StoreUnavailable, UnknownTag
from dispenser.readiness import not_ready


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
DRY = "PostgreSQL cannot be reached and no segment IDs are buffered"


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


def test_postgresql_down_is_ready_while_ids_are_buffered() -> None:
    """The store failing with IDs in hand: ready (they are served); with every buffer dry: not ready."""
    failing = Tag(Buffer(0), StoreUnavailable("down"))
    riding = Allocator({"a": failing, "b": Tag(Buffer(500), StoreUnavailable("down"))})
    assert not_ready(segment_worker(allocator=riding)) == []
    assert not_ready(segment_worker(allocator=Allocator({"a": failing}))) == [DRY]
    assert not_ready(segment_worker(postgres=Store(connected=False))) == [DRY]
    # A tag-level error that is not the store's (an unknown tag) says nothing about reaching PostgreSQL.
    unknown = Allocator({"gone": Tag(Buffer(0), UnknownTag("gone"))})
    assert not_ready(segment_worker(allocator=unknown)) == []


def test_snowflake_needs_its_worker_id() -> None:
    """A snowflake worker without its lease (or not started) is not ready; the enricher skips NATS."""
    config = load_config(
        environ={"DISPENSER_SEGMENT_ENABLED": "false", "DISPENSER_SNOWFLAKE_ENABLED": "true"}
    )
    lease = "the snowflake worker ID is not held (registering, or the lease was lost)"
    assert not_ready(FakeWorker(config, snowflake=Snowflake())) == []
    assert not_ready(FakeWorker(config, snowflake=Snowflake(holds_lease=False))) == [lease]
    assert not_ready(FakeWorker(config, snowflake=None)) == [lease]
    enricher = load_config(environ={})
    assert not_ready(FakeWorker(enricher, serve=False, nc=None)) == []
