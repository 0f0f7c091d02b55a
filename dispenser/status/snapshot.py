"""What one worker holds and does now, as plain data: the status page's (``/status``, ``/status.json``).

Read from the objects that already hold it, as ``/metrics`` reads them, nothing counted anew: the buffers
(:meth:`~dispenser.service.segments.TagAllocator.stats`), the rate event the worker publishes for each tag
(:meth:`~dispenser.service.rates.RateBook.event`: rate, peak, runway, fetches), the next step and why
(:meth:`~dispenser.service.rates.RateBook.sizing`), the peers' last events, the snowflake generator's
worker ID, lease and clock counters, the dispatchers' error counts, the readiness reasons. The page:
``docs/operations.md`` ("The status page").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from dispenser import __version__
from dispenser.core.segment import SegmentStats
from dispenser.messages import Kind, RateEvent
from dispenser.service.observed import ObservedWorker
from dispenser.service.rates import RateBook
from dispenser.service.segments import TagAllocator
from dispenser.service.snowflake import SnowflakeGenerator
from dispenser.status.errors import LoggedError

__all__ = [
    "ClockCheck",
    "ErrorCount",
    "PeerStatus",
    "SegmentRun",
    "SegmentTag",
    "SnowflakeStatus",
    "SnowflakeTag",
    "StatusSources",
    "WorkerStatus",
    "worker_status",
]


@dataclass(slots=True)
class ClockCheck:
    """What the snowflake clock check against the live peers last found (the worker sets it)."""

    offset_ms: float | None = None
    """The peers' mean clock minus ours, in ms (``None``: no peer answered, or not checked)."""
    peers: int = 0
    """How many peers answered."""
    at_ms: int | None = None
    """When (Unix ms; ``None``: never checked, as without NATS)."""

    def record(self, offset_ms: float | None, peers: int, at_ms: int) -> None:
        """A check's result: the mean offset of ``peers`` answers, at ``at_ms``."""
        self.offset_ms, self.peers, self.at_ms = offset_ms, peers, at_ms


StatusSources = ObservedWorker
"""What the snapshot reads of a worker: what ``/metrics`` reads (``dispenser.app.operations.Observed``)."""


class SegmentRun(msgspec.Struct, kw_only=True):
    """One buffered segment, in IDs (a strided tag's: ``first, first + stride, …``)."""

    first: int
    last: int
    next: int
    """The next ID it hands out (past ``last`` when used up)."""
    left: int


class PeerStatus(msgspec.Struct, kw_only=True):
    """A live peer's last rate event for the tag."""

    worker: str
    datacenter: str
    ids_per_s: float
    peak_ids_per_s: float
    step: int | None
    ids_buffered: int
    runway_s: float | None
    age_s: float
    """Seconds since the peer measured (by its clock, against ours)."""


class SegmentTag(msgspec.Struct, kw_only=True):
    """One segment tag on this worker."""

    tag: str
    step: int | None
    """The size of the last segment fetched."""
    configured_step: int | None
    """The tag's ``leaf_alloc.step``: the floor."""
    next_step: int | None
    """The size the next fetch asks for (``None``: the configured step is not known yet)."""
    why: str
    """Why the next step is that size: ``floor``, ``cap``, ``kept``, ``sized`` (see ``why_detail``), ``fixed``."""
    why_detail: str
    ids_buffered: int
    current: SegmentRun | None
    queued: list[SegmentRun]
    fetching: bool
    stride: int
    fetches: int
    fetch_errors: int
    fetches_per_min: float | None
    ids_per_s: float
    peak_ids_per_s: float
    ids_total: int
    runway_s: float | None
    """Seconds the buffers last at the peak (or the current rate, if higher); ``None``: no demand."""
    peers: list[PeerStatus]
    last_error: str | None
    """The last fetch error or refusal, ``code: message`` (``None``: none)."""


class SnowflakeTag(msgspec.Struct, kw_only=True):
    """One snowflake tag this worker has served (its meter: at most ``MAX_SNOWFLAKE_METERS``)."""

    tag: str
    ids_per_s: float
    peak_ids_per_s: float
    ids_total: int
    peers: list[PeerStatus]


class SnowflakeStatus(msgspec.Struct, kw_only=True):
    """The snowflake generator: its worker ID, lease, reserved mark and clock."""

    worker_id: int
    datacenter_id: int
    mode: str
    holds_lease: bool
    reserved_ms: int
    """The wall-clock ms up to which IDs go out without recording a new high-water mark."""
    clock_offset_ms: float | None
    clock_peers: int
    clock_checked_ms: int | None
    clock_waits: int
    clock_back_waits: int
    rollbacks_refused: int
    refusal: str | None
    layout: str
    """``timestamp+datacenter+worker+sequence`` bits, and the epoch."""
    tags: list[SnowflakeTag]


class ErrorCount(msgspec.Struct, kw_only=True):
    """Error replies of one code, since the start."""

    kind: str
    code: str
    count: int


class WorkerStatus(msgspec.Struct, kw_only=True):
    """The whole page."""

    worker: str
    """The worker's name in its rate events (``<host>:<pid>:<random>``)."""
    datacenter: str
    version: str
    at_ms: int
    """When this snapshot was taken (Unix ms)."""
    not_ready: list[str]
    """Why ``/readyz`` says not ready (empty: ready)."""
    cannot_issue: list[str]
    segments: list[SegmentTag]
    snowflake: SnowflakeStatus | None
    errors: list[ErrorCount]
    recent_errors: list[LoggedError]


def worker_status(
    sources: StatusSources,
    *,
    not_ready: Sequence[str] = (),
    cannot_issue: Sequence[str] = (),
    clock_check: ClockCheck | None = None,
    recent_errors: Sequence[LoggedError] = (),
    snowflake_mode: str = "",
) -> WorkerStatus:
    """The snapshot of a worker now, from its ``sources`` and what the worker says beside them.

    Args:
        sources: the worker's generators, rates and dispatchers.
        not_ready: why ``/readyz`` says not ready.
        cannot_issue: which kinds it cannot issue now, and why.
        clock_check: the last snowflake clock check against the peers.
        recent_errors: its last warnings and errors, newest first.
        snowflake_mode: how its worker ID is registered (``snowflake.mode``).
    """
    rates = sources.rates
    allocator = sources.allocator
    wall_ms = sources.clock.wall_ms()
    segments = []
    if allocator is not None:
        for tag, tag_allocator in sorted(allocator.tags.items()):
            segments.append(_segment_tag(rates, tag, tag_allocator, wall_ms / 1000))
    errors = [
        ErrorCount(kind=kind, code=code, count=count)
        for kind, dispatcher in sorted(sources.dispatchers.items())
        for code, count in sorted(dispatcher.errors.items())
    ]
    snowflake = None
    if sources.snowflake is not None:
        snowflake = _snowflake(
            rates, sources.snowflake, clock_check or ClockCheck(), snowflake_mode, wall_ms / 1000
        )
    return WorkerStatus(
        worker=rates.worker,
        datacenter=rates.datacenter,
        version=__version__,
        at_ms=wall_ms,
        not_ready=list(not_ready),
        cannot_issue=list(cannot_issue),
        segments=segments,
        snowflake=snowflake,
        errors=errors,
        recent_errors=list(recent_errors),
    )


def _peers(rates: RateBook, kind: Kind, tag: str, wall_s: float) -> list[PeerStatus]:
    events = rates.peers(kind, tag)
    return [
        PeerStatus(
            worker=event.worker,
            datacenter=event.datacenter,
            ids_per_s=event.ids_per_s,
            peak_ids_per_s=event.peak_ids_per_s,
            step=event.step,
            ids_buffered=event.ids_buffered,
            runway_s=event.runway_s,
            age_s=round(max(0.0, wall_s - event.time), 1),
        )
        for event in sorted(events, key=lambda e: e.worker)
    ]


def _segment_tag(rates: RateBook, tag: str, allocator: TagAllocator, wall_s: float) -> SegmentTag:
    event: RateEvent = rates.event("segment", tag, allocator)
    stats = allocator.stats()
    residue = allocator.residue

    def run(segment: SegmentStats) -> SegmentRun:
        return SegmentRun(
            first=residue.id_of(segment.first),
            last=residue.id_of(segment.last),
            next=residue.id_of(segment.position),
            left=segment.remaining,
        )

    next_step: int | None = None
    why, detail = "unknown", "the configured step is not known yet (no segment fetched)"
    if allocator.step is not None:
        next_step, why = rates.sizing(allocator)
        detail = _why_detail(rates, allocator, why)
    error = allocator.refusal or allocator.last_error
    return SegmentTag(
        tag=tag,
        step=event.step,
        configured_step=event.configured_step,
        next_step=next_step,
        why=why,
        why_detail=detail,
        ids_buffered=event.ids_buffered,
        current=run(stats.current) if stats.current is not None else None,
        queued=[run(segment) for segment in stats.next],
        fetching=stats.fetching,
        stride=residue.stride,
        fetches=event.fetches,
        fetch_errors=allocator.fetch_errors,
        fetches_per_min=event.fetches_per_min,
        ids_per_s=event.ids_per_s,
        peak_ids_per_s=event.peak_ids_per_s,
        ids_total=event.ids_total,
        runway_s=event.runway_s,
        peers=_peers(rates, "segment", tag, wall_s),
        last_error=None if error is None else f"{error.code}: {error.message}",
    )


def _why_detail(rates: RateBook, allocator: TagAllocator, why: str) -> str:
    """The reason in words, with the figures the rule used."""
    policy = rates.policy
    if why == "fixed":
        return "the configured step: rate.adaptive_step is off"
    view = rates.view("segment", allocator.tag, allocator.consumption_rate())
    ids_per_s, measure = policy.demand(view)
    seconds = policy.segment_seconds
    target = f"{seconds:g} s x {ids_per_s:,.1f} IDs/s ({measure}) = {seconds * ids_per_s:,.0f}"
    if why == "floor":
        return f"the configured step, the floor: the demand asks less ({target})"
    if why == "cap":
        return f"rate.max_step, the cap: the demand asks more ({target})"
    if why == "kept":
        return f"the last step, kept: within {policy.hysteresis:.0%} above the target ({target})"
    return f"sized for {target}, with room for noise, rounded up"


def _snowflake(
    rates: RateBook, generator: SnowflakeGenerator, check: ClockCheck, mode: str, wall_s: float
) -> SnowflakeStatus:
    tags = []
    for (kind, tag), _meter in sorted(rates.meters(), key=lambda item: item[0]):
        if kind != "snowflake":
            continue
        event = rates.event("snowflake", tag)
        tags.append(
            SnowflakeTag(
                tag=tag,
                ids_per_s=event.ids_per_s,
                peak_ids_per_s=event.peak_ids_per_s,
                ids_total=event.ids_total,
                peers=_peers(rates, "snowflake", tag, wall_s),
            )
        )
    layout = generator.layout
    refusal = generator.refusal
    bits = f"{layout.timestamp_bits}+{layout.datacenter_bits}+{layout.worker_bits}+{layout.sequence_bits}"
    return SnowflakeStatus(
        worker_id=generator.worker_id,
        datacenter_id=generator.datacenter_id,
        mode=mode,
        holds_lease=generator.holds_lease,
        reserved_ms=generator.reserved_ms,
        clock_offset_ms=None if check.offset_ms is None else round(check.offset_ms, 1),
        clock_peers=check.peers,
        clock_checked_ms=check.at_ms,
        clock_waits=generator.clock_waits,
        clock_back_waits=generator.clock_back_waits,
        rollbacks_refused=generator.rollbacks_refused,
        refusal=None if refusal is None else f"{refusal.code}: {refusal.message}",
        layout=f"{bits} bits from {layout.epoch_ms} ms",
        tags=tags,
    )
