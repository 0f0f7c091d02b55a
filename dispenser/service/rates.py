"""Consumption rates across the fleet: this worker's meters, its peers' events, and the adaptive step.

:class:`RateBook` keeps this worker's meters and its peers' latest events and is the allocator's
:data:`~dispenser.service.segments.Sizer`; :class:`RatePublisher` publishes each tag's event every
``interval`` and saves the peaks every ``persist_interval``. No broker here: sinks are callables. The
adaptive step: ``docs/operations.md``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from dispenser.core.lru import ProtectedLru
from dispenser.core.rate import FleetPeak, PeakSample, RateMeter, runway_seconds
from dispenser.core.step import FleetView, StepPolicy, StepWhy
from dispenser.messages import Kind, RateEvent
from dispenser.ports import Clock, SegmentStore
from dispenser.service.segments import SegmentAllocator, TagAllocator

__all__ = ["MAX_SNOWFLAKE_METERS", "RateBook", "RatePublisher", "RateSettings", "worker_name"]

log = logging.getLogger(__name__)

MAX_SNOWFLAKE_METERS = 512
"""Snowflake serves any tag name: a worker meters this many snowflake tags at most (the least recently used
newcomer gives way to a new one, see :class:`~dispenser.core.lru.ProtectedLru`)."""

EventSink = Callable[[RateEvent], Awaitable[None]]
"""Publishes one event (NATS subject, Kafka topic); may raise: the publisher logs and carries on."""


def worker_name() -> str:
    """``<host>:<pid>:<random>``: tells workers apart in events, also across restarts of one process slot."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


@dataclass(frozen=True, slots=True)
class RateSettings:
    """How rates are measured, shared and turned into steps."""

    interval: float = 5.0
    """Seconds between a worker's events for a tag."""
    window: int = 60
    """Seconds averaged for the current rate and for each peak candidate."""
    retention: float = 86_400.0
    """Seconds a peak is remembered."""
    peak_sustain: int = 2
    """Windows over which a peak candidate must hold (:class:`~dispenser.core.rate.RateMeter`'s ``sustain``)."""
    stale_after: float = 15.0
    """A peer not heard from for this long no longer counts in the fleet."""
    adaptive_step: bool = True
    """Size segments from the rates (else: the configured step, as Leaf does)."""
    persist_interval: float = 60.0
    """Seconds between saves of the peaks."""


class RateBook:
    """This worker's meters and its peers' latest events; the adaptive step's inputs."""

    def __init__(
        self,
        clock: Clock,
        settings: RateSettings,
        policy: StepPolicy,
        worker: str | None = None,
        datacenter: str = "",
        *,
        max_snowflake_meters: int = MAX_SNOWFLAKE_METERS,
    ) -> None:
        self.clock = clock
        """The clock rates are measured on (the publisher sleeps on it too)."""
        self.settings = settings
        self.policy = policy
        self.worker = worker or worker_name()
        self.datacenter = datacenter
        """This worker's datacenter, named in its events."""
        # Segment tags are the store's (it refuses others), each meter held by its tag's allocator too: never
        # evicted. Snowflake tags are anyone's to invent: a bounded table, idle ones forgotten.
        self._meters: dict[tuple[str, str], RateMeter] = {}
        self._snowflake: ProtectedLru[str, RateMeter] = ProtectedLru(max_snowflake_meters)
        self._fleet_peaks: dict[tuple[str, str], FleetPeak] = {}
        self._peers: dict[tuple[str, str], dict[str, tuple[RateEvent, float]]] = {}

    def _new_meter(self, now: float) -> RateMeter:
        settings = self.settings
        return RateMeter(
            now, window=settings.window, retention=settings.retention, sustain=settings.peak_sustain
        )

    def meter(self, kind: Kind, tag: str) -> RateMeter:
        """The meter of ``tag``, used now (created on first use): this worker's own rates and peak.

        A snowflake tag's meter may be one just made, in place of one evicted or forgotten as idle (see
        :meth:`sweep`); nothing but rates, events and metrics reads it.
        """
        return self._meter_at(kind, tag, self.clock.monotonic())

    def _meter_at(self, kind: Kind, tag: str, now: float) -> RateMeter:
        if kind == "snowflake":
            meter = self._snowflake.get(tag, now)
            if meter is None:
                meter = self._new_meter(now)
                evicted = self._snowflake.add(tag, meter, now)
                if evicted is not None:
                    self._forget("snowflake", evicted[0])
            return meter
        key = (kind, tag)
        meter = self._meters.get(key)
        if meter is None:
            meter = self._meters[key] = self._new_meter(now)
        return meter

    def record(self, kind: Kind, tag: str, ids: int) -> None:
        """Count ``ids`` IDs handed out now for ``tag`` in one request (a snowflake tag always gets a meter)."""
        now = self.clock.monotonic()
        self._meter_at(kind, tag, now).record(now, ids)

    def record_snowflake(self, tag: str, ids: int) -> None:
        """``record("snowflake", tag, ids)``, two calls shorter: every snowflake request passes here."""
        now = self.clock.monotonic()
        meter = self._snowflake.get(tag, now)
        if meter is None:
            meter = self._meter_at("snowflake", tag, now)
        meter.record(now, ids)

    def _existing(self, kind: str, tag: str) -> RateMeter | None:
        """The meter of ``tag`` if it has one, not counted as a use."""
        return self._snowflake.peek(tag) if kind == "snowflake" else self._meters.get((kind, tag))

    def meters(self) -> list[tuple[tuple[str, str], RateMeter]]:
        """Every meter, by (kind, tag)."""
        snowflake = [(("snowflake", tag), meter) for tag, meter in self._snowflake.items()]
        return list(self._meters.items()) + snowflake

    def known(self, kind: Kind, tag: str) -> bool:
        """Whether ``tag`` has a meter."""
        return self._existing(kind, tag) is not None

    def count(self, kind: Kind) -> int:
        """How many meters of ``kind`` there are."""
        if kind == "snowflake":
            return len(self._snowflake)
        return sum(1 for meter_kind, _ in self._meters if meter_kind == kind)

    def sweep(self) -> None:
        """Forget what no longer says anything: idle snowflake meters, silent peers, expired fleet peaks.

        A snowflake tag used in one second only (an invented name, most likely) is forgotten a window after;
        one used in two seconds or more once idle for the retention (by then its peak has expired too).
        """
        now = self.clock.monotonic()
        settings = self.settings
        for tag, _ in self._snowflake.expire(
            now, newcomer_idle=settings.window, established_idle=settings.retention
        ):
            self._forget("snowflake", tag)
        oldest = now - settings.stale_after
        for key, known in list(self._peers.items()):
            for worker in [w for w, (_, seen) in known.items() if seen < oldest]:
                del known[worker]
            if not known:
                del self._peers[key]
        for key in [k for k, peak in self._fleet_peaks.items() if peak.snapshot(now) is None]:
            if self._existing(*key) is None:
                del self._fleet_peaks[key]

    def _forget(self, kind: Kind, tag: str) -> None:
        """Drop what the book holds about ``tag`` besides its meter (already gone)."""
        self._fleet_peaks.pop((kind, tag), None)
        self._peers.pop((kind, tag), None)

    def segment_meter(self, tag: str) -> RateMeter:
        """The allocator's meter factory."""
        return self.meter("segment", tag)

    def restore(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Take back saved fleet peaks (``tag → (rate, unix seconds)``): what the fleet's peak was.

        They are not this worker's own peak (its events keep saying what it measured, so no peer counts
        the fleet twice): they stand in for the workers that are gone, see :class:`FleetPeak`.
        """
        mono, wall = self.clock.monotonic(), self.clock.wall_ms() / 1000
        for tag, (rate, seen) in peaks.items():
            sample = PeakSample(rate, mono - (wall - seen))  # the meters run on the monotonic clock
            self._fleet_peak(kind, tag).restore(sample, mono)

    def peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """``tag → (the fleet's peak, unix seconds last seen)`` of every tag with one, to save."""
        mono, wall = self.clock.monotonic(), self.clock.wall_ms() / 1000
        saved = {}
        for key_kind, tag in list(self._fleet_peaks.keys() | self._meters.keys()):  # segment tags: no LRU
            if key_kind != kind:
                continue
            self.fleet_peak(kind, tag)  # takes in the latest sum of the live workers' peaks
            snapshot = self._fleet_peak(kind, tag).snapshot(mono)
            if snapshot is not None and snapshot.rate > 0:
                saved[tag] = (snapshot.rate, wall - (mono - snapshot.at))
        return saved

    def _fleet_peak(self, kind: Kind, tag: str) -> FleetPeak:
        key = (kind, tag)
        remembered = self._fleet_peaks.get(key)
        if remembered is None:
            remembered = self._fleet_peaks[key] = FleetPeak(self.settings.retention)
        return remembered

    def fleet_peak(self, kind: Kind, tag: str) -> float:
        """The fleet's peak for ``tag``: the live workers' peaks summed, or more if remembered.

        Remembered: the highest such sum seen within the retention, by this worker or saved by any.
        """
        now = self.clock.monotonic()
        meter = self._existing(kind, tag)
        measured = meter.peak(now) if meter is not None else 0.0
        measured += sum(e.peak_ids_per_s for e in self.peers(kind, tag))
        return self._fleet_peak(kind, tag).update(measured, now)

    # -- the fleet ---------------------------------------------------------------------------------------

    def observe(self, event: RateEvent) -> None:
        """Remember a peer's event (this worker's own are ignored)."""
        if event.worker != self.worker:
            self._peers.setdefault((event.kind, event.tag), {})[event.worker] = (
                event,
                self.clock.monotonic(),
            )

    def peers(self, kind: Kind, tag: str) -> list[RateEvent]:
        """The live peers' latest events for ``tag`` (stale ones dropped)."""
        known = self._peers.get((kind, tag))
        if not known:
            return []
        oldest = self.clock.monotonic() - self.settings.stale_after
        for worker in [w for w, (_, seen) in known.items() if seen < oldest]:
            del known[worker]
        return [event for event, _ in known.values()]

    def view(self, kind: Kind, tag: str, recent: float = 0.0) -> FleetView:
        """This worker's and its live peers' rates for ``tag`` (``recent``: see :class:`FleetView`)."""
        now = self.clock.monotonic()
        meter = self._existing(kind, tag) or self.meter(kind, tag)
        own_rate, own_peak = meter.rate(now), meter.peak(now)
        peers = self.peers(kind, tag)
        return FleetView(
            own_rate=own_rate,
            own_peak=own_peak,
            fleet_rate=own_rate + sum(e.ids_per_s for e in peers),
            fleet_peak=own_peak + sum(e.peak_ids_per_s for e in peers),
            workers=1 + len(peers),
            recent=recent,
            remembered_peak=self.fleet_peak(kind, tag),
        )

    def size(self, allocator: TagAllocator) -> int:
        """The :data:`~dispenser.service.segments.Sizer`: the step of ``allocator``'s next fetch."""
        return self.sizing(allocator)[0]

    def sizing(self, allocator: TagAllocator) -> tuple[int, StepWhy | Literal["fixed"]]:
        """The step of ``allocator``'s next fetch, and why (``fixed``: ``rate.adaptive_step`` is off)."""
        configured = allocator.step or 1
        if not self.settings.adaptive_step:
            return configured, "fixed"
        view = self.view("segment", allocator.tag, allocator.consumption_rate())
        return self.policy.decide(configured, allocator.last_step, view)

    # -- events ------------------------------------------------------------------------------------------

    def event(self, kind: Kind, tag: str, allocator: TagAllocator | None = None) -> RateEvent:
        """This worker's event for ``tag`` now (and, every time, the fleet's peak takes in the live sum)."""
        # Sampled here, every interval: a peer's last peak is still counted for ``stale_after`` (several
        # intervals) after its events stop, so the sum is always taken while it still includes it.
        self.fleet_peak(kind, tag)
        now = self.clock.monotonic()
        meter = self._existing(kind, tag) or self.meter(kind, tag)  # reading is no use of a snowflake meter
        rate, peak = meter.rate(now), meter.peak(now)
        buffered = allocator.buffer.remaining if allocator is not None else 0
        # At the peak, or at the current rate while that is higher (a rise, or a burst, not yet sustained).
        runway = runway_seconds(buffered, max(peak, rate)) if allocator is not None else math.inf
        return RateEvent(
            tag=tag,
            kind=kind,
            worker=self.worker,
            time=self.clock.wall_ms() / 1000,
            window_s=len_window(meter),
            ids_per_s=round(rate, 3),
            requests_per_s=round(meter.request_rate(now), 3),
            peak_ids_per_s=round(peak, 3),
            step=allocator.last_step if allocator is not None else None,
            configured_step=allocator.step if allocator is not None else None,
            ids_buffered=buffered,
            runway_s=None if math.isinf(runway) else round(runway, 1),
            fetches=allocator.fetches if allocator is not None else 0,
            fetches_per_min=round(allocator.fetches_per_minute(), 2) if allocator is not None else None,
            ids_total=meter.ids_issued,
            datacenter=self.datacenter,
        )

    def events(self, allocator: SegmentAllocator | None) -> Iterable[RateEvent]:
        """One event per tag this worker serves or has served."""
        tags = dict(allocator.tags) if allocator is not None else {}
        for tag, tag_allocator in tags.items():
            yield self.event("segment", tag, tag_allocator)
        for tag, _ in self._snowflake.items():
            yield self.event("snowflake", tag)


def len_window(meter: RateMeter) -> int:
    """The window a meter averages over."""
    return meter.window


class RatePublisher:
    """Every ``interval``: publish each tag's event to every sink; every ``persist_interval``: save peaks."""

    def __init__(
        self,
        book: RateBook,
        allocator: SegmentAllocator | None,
        sinks: list[EventSink],
        peak_store: SegmentStore | None = None,
    ) -> None:
        self._book = book
        self._allocator = allocator
        self._sinks = sinks
        self._peak_store = peak_store
        self.published = 0

    async def publish_once(self) -> None:
        """Publish the current events (a sink that fails is logged; the others still get them)."""
        self._book.sweep()
        for event in self._book.events(self._allocator):
            for sink in self._sinks:
                try:
                    await sink(event)
                except Exception as exc:
                    log.warning("could not publish the rate event of %r: %s", event.tag, exc)
            self.published += 1

    async def save_peaks(self) -> None:
        """Persist the segment peaks now (failures are logged: the next save tries again)."""
        if self._peak_store is None:
            return
        peaks = self._book.peaks("segment")
        if not peaks:
            return
        try:
            await self._peak_store.save_peaks("segment", peaks)
        except Exception as exc:
            log.warning("could not save the rate peaks: %s", exc)

    async def run(self) -> None:
        """Publish and save until cancelled (saving once more on the way out)."""
        settings = self._book.settings
        every = max(1, round(settings.persist_interval / settings.interval))
        rounds = 0
        try:
            while True:
                await self._book.clock.sleep(settings.interval)
                await self.publish_once()
                rounds += 1
                if rounds % every == 0:
                    await self.save_peaks()
        finally:
            await asyncio.shield(self.save_peaks())
