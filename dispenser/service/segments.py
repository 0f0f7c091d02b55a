"""The segment allocator: drives one :class:`SegmentBuffer` per tag against a :class:`SegmentStore`.

It adds time and I/O to the pure refill engine: one background fetch per tag, requests waiting on it up to
their deadline, retries with capped backoff, tags found by a periodic refresh and at once on an unknown
tag. See ``docs/segment.md`` ("The double buffer", "The refill engine").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dispenser.core.errors import DispenserError, ResidueOverlap, StoreUnavailable, TagExhausted, UnknownTag
from dispenser.core.ids import IdBatch, Range
from dispenser.core.rate import RateMeter
from dispenser.core.refill import Again, Done, Fetch, Overlap, Refill, Stop
from dispenser.core.residue import LEAF, Residue
from dispenser.core.segment import NEED_SEGMENT, BufferStats
from dispenser.ports import Allocation, Clock, ResidueCheck, SegmentStore
from dispenser.service.daily import DailyTag, DailyTags
from dispenser.service.refiller import Refiller, Refused
from dispenser.service.timing import run_within

__all__ = ["AllocatorSettings", "ResidueCheck", "SegmentAllocator", "Sizer", "TagAllocator"]

FETCH_RATE_SPAN = 60.0
"""Seconds over which :meth:`TagAllocator.fetches_per_minute` counts fetches."""

Sizer = Callable[["TagAllocator"], int]
"""The step of a tag's next fetch, given its allocator (configured step, last step, meter). Never below
the configured step: the operator's floor."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AllocatorSettings:
    """Tuning of the allocator; the defaults are Leaf's where Leaf has one."""

    prefetch_threshold: float = 0.0
    """Fetch the next segment once more than this fraction of the current one is used (0: at the switch;
    Leaf's is 0.1)."""
    retry_initial: float = 0.05
    """First backoff after a failed fetch, in seconds; doubles up to ``retry_max``."""
    retry_max: float = 2.0
    refresh_interval: float = 60.0
    """Seconds between refreshes of the tag list (Leaf: 60)."""
    unknown_tag_refresh_interval: float = 1.0
    """Requests for unknown tags refresh the tag list at most this often, so a flood of bogus tags
    cannot turn into a flood of queries."""


class TagAllocator:
    """One tag's refill engine, its single in-flight fetch from the store, and the requests waiting on it.

    The decisions are the engine's (:class:`~dispenser.core.refill.Refill`), the fetching and waiting the
    shared shell's (:class:`~dispenser.service.refiller.Refiller`); this class is the store's side of it
    (:class:`_StoreSource`) and the takes.
    """

    def __init__(
        self,
        tag: str,
        store: SegmentStore,
        clock: Clock,
        settings: AllocatorSettings,
        *,
        step: int | None = None,
        on_unknown: Callable[[str], None] | None = None,
        sizer: Sizer | None = None,
        meter: RateMeter | None = None,
        check: ResidueCheck | None = None,
    ) -> None:
        self.tag = tag
        self.residue = LEAF
        """The tag's residue class, from its first segment: the buffer holds its ordinals (Leaf's: the IDs)."""
        self.refusal: DispenserError | None = None
        """Why no more IDs of this tag are handed out, buffered ones included (None: they are)."""
        self.check = check
        """Claims the tag's class before its first ID (None: not checked)."""
        self._claimed: Residue | None = None
        self.meter = meter if meter is not None else RateMeter(clock.monotonic())
        """IDs handed out, per second."""
        self.refill = Refill(
            self.meter,
            prefetch_threshold=settings.prefetch_threshold,
            overlap=Overlap.REFUSE,  # one store row grants increasing segments: an overlap is a fault
        )
        self.buffer = self.refill.buffer
        self.step = step
        """The configured step, once known (from the tag list or the last fetch)."""
        self.fetches = 0
        """Segments fetched (one store round trip each, failures not counted)."""
        self.fetch_seconds = 0.0
        """Time spent in successful fetches, in all."""
        self.fetch_errors = 0
        """Fetches that failed: the store unreachable or refusing (retried), or the tag exhausted."""
        self.steps: collections.deque[int] = collections.deque(maxlen=64)
        """The sizes of the last segments fetched, oldest first."""
        # When the recent fetches completed (monotonic); bounded so a tag fetching in a tight loop
        # (a misconfigured tiny step) cannot grow it: past the bound the figure saturates, loudly high.
        self._fetched_at: collections.deque[float] = collections.deque(maxlen=1024)
        self._started_at = clock.monotonic()
        self._sizer = sizer
        self.last_error: DispenserError | None = None
        self._store = store
        self._clock = clock
        self._on_unknown = on_unknown
        self._closed = False
        self._stopping = False
        self._refiller = Refiller(
            self.refill,
            _StoreSource(self),
            clock,
            retry_initial=settings.retry_initial,
            retry_max=settings.retry_max,
            name=f"fetch-segment-{tag}",
        )

    @property
    def last_step(self) -> int | None:
        """The size of the last segment fetched."""
        return self.refill.last_size

    # -- the hot path ------------------------------------------------------------------------------

    def try_take(self, count: int) -> IdBatch | None:
        """Take from the buffer without waiting; ``None`` when it is short (then await :meth:`take`)."""
        if self.refusal is not None:
            return None
        batch = self.refill.take(count, self._clock.monotonic())
        if self.buffer.wants_fetch:  # the engine's wants_fetch, one property call fewer
            self._start_fetch()
        if batch is NEED_SEGMENT:
            return None
        return self.residue.batch(batch)

    def try_run(self, count: int) -> Range | None:
        """:meth:`try_take` as one range of the current segment of a tag of Leaf's class, else ``None``.

        ``None`` takes nothing (call :meth:`try_take`): the current segment holds too few, the tag is of a
        residue class (its ordinals are not its IDs), or it is refused.
        """
        if self.refusal is not None or self.residue.stride != 1:
            return None
        run = self.refill.take_within(count, self._clock.monotonic())
        if self.buffer.wants_fetch:
            self._start_fetch()
        return run

    async def take(self, count: int, deadline: float) -> IdBatch:
        """Take ``count`` IDs, waiting for the in-flight fetch until ``deadline`` (monotonic seconds).

        Raises:
            UnknownTag: the tag was removed from the store.
            StoreUnavailable: the deadline passed before a segment arrived.
        """
        refill = self.refill
        while True:
            if self.refusal is not None:
                raise self.refusal
            batch = refill.take(count, self._clock.monotonic())
            if refill.wants_fetch:
                self._start_fetch()
            if batch is not NEED_SEGMENT:
                return self.residue.batch(batch)
            if self._closed:
                raise self.last_error or StoreUnavailable("the worker is shutting down")
            refill.need(count)
            self._start_fetch()
            if not await self._refiller.wait(deadline):
                raise self._timeout_error()
            if isinstance(self.last_error, (UnknownTag, TagExhausted)):
                raise self.last_error

    def consumption_rate(self) -> float:
        """IDs/s handed out since the previous fetch started (0 if unknown).

        A fetch starts when the current segment is first drawn from (at the switch, or once
        ``prefetch_threshold`` of it is used), so the time between two is about one segment's life: a rise
        in demand shows here at the next fetch, before any per-second average moves.
        """
        return self.refill.recent_rate(self._clock.monotonic())

    def fetches_per_minute(self) -> float:
        """Successful fetches per minute over the last :data:`FETCH_RATE_SPAN` seconds (or since start).

        This is the database load a tag costs, the figure the adaptive step is there to keep near
        ``60 / segment_seconds``; rate events carry it so one event is enough to show it.
        """
        now = self._clock.monotonic()
        span = min(FETCH_RATE_SPAN, now - self._started_at)
        if span <= 0:
            return 0.0
        since = now - span
        while self._fetched_at and self._fetched_at[0] < since:
            self._fetched_at.popleft()
        return len(self._fetched_at) * 60.0 / max(span, 1.0)

    def stats(self) -> BufferStats:
        """The buffer's snapshot."""
        return self.buffer.stats()

    # -- fetching ----------------------------------------------------------------------------------

    def _timeout_error(self) -> StoreUnavailable:
        detail = self.last_error.message if self.last_error else "no segment arrived in time"
        return StoreUnavailable(
            f"no IDs buffered for tag {self.tag!r} and the next segment is late ({detail})"
        )

    def _start_fetch(self) -> None:
        if not self._closed:
            self._refiller.kick()

    async def _segment(self, size: int | None) -> list[Range]:
        """One attempt: the store's next segment of ``size`` (its class claimed first), as the engine's ranges.

        Raises:
            Refused: the tag's class refused, the tag exhausted or gone from the store, the tag refused while
                this fetch was in flight, or the segment of another class than the IDs held (:meth:`_ended`).
            DispenserError: the store's or the claim's (and anything else: the fetch is retried).
        """
        started = time.perf_counter()
        try:
            allocation = await self._allocate(size)
        except (ResidueOverlap, TagExhausted, UnknownTag) as exc:
            self._ended(exc)
            raise Refused(exc) from exc
        if self.refusal is not None and not self._stopping:
            raise Refused(self.refusal)  # refused while this fetch was in flight: nothing of it is served
        self.step = allocation.configured_step
        segment = allocation.segment
        self.steps.append(segment.size)
        self.fetches += 1
        self._fetched_at.append(self._clock.monotonic())
        self.fetch_seconds += time.perf_counter() - started
        if allocation.residue != self.residue and self.buffer.high >= 0:
            # The buffer holds ordinals of another class: mixing the two could repeat an ID.
            log.error(
                "refusing segment of tag %r: its stride/offset changed from %d/%d to %d/%d while "
                "this worker held its IDs; restart the worker (and never change a tag's class)",
                self.tag,
                self.residue.stride,
                self.residue.offset,
                allocation.residue.stride,
                allocation.residue.offset,
            )
            self.last_error = StoreUnavailable(f"the stride of {self.tag!r} changed under this worker")
            self._closed = True
            raise Refused(self.last_error)
        self.residue = allocation.residue
        return [(segment.first, segment.last)]

    async def _allocate(self, step: int | None) -> Allocation:
        """The next segment from the store, its residue class claimed first if it is new to this tag.

        Raises:
            ResidueOverlap: the class is refused (this segment is burnt).
            DispenserError: the store's or the claim's (and anything else: the fetch is retried).
        """
        high = self.buffer.high  # a range returned by another worker is taken only above the IDs held
        above = -1 if high < 0 else self.residue.id_of(high)
        allocation = await self._store.next_segment(self.tag, step, above=above)
        if self.check is not None and allocation.residue != self._claimed:
            # Before any ID of this class is handed out: this segment is burnt if refused.
            await self.check.claim(self.tag, allocation.residue)
            self._claimed = allocation.residue
        return allocation

    def _ended(self, exc: ResidueOverlap | TagExhausted | UnknownTag) -> None:
        """A fetch that no retry can help: the class refused, the tag exhausted, or gone from the store."""
        if isinstance(exc, ResidueOverlap):
            self.refuse(exc)
            return
        if isinstance(exc, TagExhausted):
            # What is buffered is still served, then takes get this error.
            self.fetch_errors += 1
            self.last_error = exc
            self._closed = True
            log.error("%s", exc.message)
            return
        self.last_error = exc
        self._closed = True
        if self._on_unknown is not None:
            self._on_unknown(self.tag)

    def _next_step(self) -> int | None:
        """The step of the next segment: the sizer's (or the configured) step; the engine adds a waiter's need."""
        step = self.step
        if step is not None and self._sizer is not None:
            try:
                step = max(step, self._sizer(self))
            except Exception:  # sizing is advice: a bug there must not stop the IDs
                log.exception("sizing the next segment of %r failed; using the configured step", self.tag)
        return step

    def refuse(self, error: DispenserError, *, stopping: bool = False) -> None:
        """Hand out no more IDs of this tag, buffered ones included: every take fails with ``error``.

        ``stopping`` (a clean stop, service/returns.py): a segment in flight still lands in the buffer, to be
        returned with the rest rather than lost (never handed out: every take is refused).
        """
        self._stopping = stopping
        self.refusal = self.last_error = error
        self._closed = True
        self._refiller.notify()

    async def changed(self, deadline: float) -> bool:
        """Wait for the buffer's next change (a segment installed, a fetch failed) until ``deadline``."""
        return await self._refiller.wait(deadline)

    async def close(self, reason: DispenserError | None = None) -> None:
        """Stop fetching; later takes that find the buffer short fail with ``reason``."""
        self._closed = True
        if reason is not None:
            self.last_error = reason
        await self._refiller.close()


class _StoreSource:
    """The worker's :class:`~dispenser.service.refiller.RangeSource`: a tag's segments from the store."""

    outages: tuple[type[Exception], ...] = (DispenserError,)
    peer = "the store"

    def __init__(self, owner: TagAllocator) -> None:
        self._owner = owner
        self.log = log
        self.subject = f"segment fetch for {owner.tag!r}"

    def step(self) -> int | None:
        """The sizer's (or the configured) step."""
        return self._owner._next_step()

    def outside(self) -> int:
        """Nothing is held outside the buffer."""
        return 0

    async def fetch(self, fetch: Fetch) -> list[Range]:
        """The next segment (see :meth:`TagAllocator._segment`)."""
        return await self._owner._segment(fetch.size)

    def unexpected(self, exc: Exception) -> Exception:
        """What a bug looks like to a waiter: the store unavailable."""
        return StoreUnavailable(f"unexpected {type(exc).__name__} while fetching")

    def failed(self, error: Exception) -> None:
        """Count the failure; it is the tag's last error until a segment arrives."""
        owner = self._owner
        owner.fetch_errors += 1
        owner.last_error = error if isinstance(error, DispenserError) else StoreUnavailable(str(error))

    def arrived(self, outcome: Done | Again) -> None:
        """A segment was installed: the store answers again."""
        self._owner.last_error = None

    def stopped(self, stop: Stop) -> None:
        """The store granted a segment overlapping one held: two writers share the row wrongly.

        Serving it could repeat IDs; the tag stops instead.
        """
        owner = self._owner
        log.error("refusing a segment of tag %r: %s", owner.tag, stop.reason)
        owner.last_error = StoreUnavailable(f"the store granted an overlapping segment for {owner.tag!r}")
        owner._closed = True


class SegmentAllocator:
    """All tags of one worker: finds the tag's allocator, learning new tags from the store."""

    def __init__(
        self,
        store: SegmentStore,
        clock: Clock,
        settings: AllocatorSettings | None = None,
        *,
        sizer: Sizer | None = None,
        meters: Callable[[str], RateMeter] | None = None,
    ) -> None:
        """Serve the store's tags.

        Args:
            store: where segments come from.
            clock: the clock.
            settings: tuning.
            sizer: the step of each fetch (default: the tag's configured step).
            meters: a tag's rate meter (default: a fresh one per tag).
        """
        self._store = store
        self._clock = clock
        self.settings = settings or AllocatorSettings()
        self._sizer = sizer
        self._meters = meters
        self._tags: dict[str, TagAllocator] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")
        self._refresher: asyncio.Task[None] | None = None
        self._check: ResidueCheck | None = None
        self.daily: DailyTags[TagAllocator] = DailyTags(clock, self._day_allocator, sizer)
        """The daily tags this worker knows (docs/daily.md), apart from :attr:`tags`: the plain path never
        looks there."""

    def check_residues(self, check: ResidueCheck) -> None:
        """Claim each tag's class with ``check`` before its first ID, the tags known already included."""
        self._check = check
        for allocator in self._tags.values():
            allocator.check = check

    def refuse(self, tag: str, error: DispenserError) -> None:
        """Stop handing out ``tag``'s IDs (another database serves an intersecting class)."""
        allocator = self._tags.get(tag)
        if allocator is not None:
            allocator.refuse(error)

    @property
    def tags(self) -> dict[str, TagAllocator]:
        """The tags this worker knows, by name."""
        return self._tags

    def get(self, tag: str) -> TagAllocator | None:
        """The tag's allocator if the tag is known (the hot path: no I/O)."""
        return self._tags.get(tag)

    def try_take(self, tag: str, count: int) -> IdBatch | None:
        """IDs from a known tag's buffer at once, or ``None`` (unknown tag, or the buffer is short)."""
        allocator = self._tags.get(tag)
        if allocator is not None:
            return allocator.try_take(count)
        daily = self.daily.tags.get(tag)  # only once the plain tags missed: they pay nothing for it
        return None if daily is None else daily.try_take(count)

    def try_run(self, tag: str, count: int) -> Range | None:
        """``count`` IDs of a known plain tag as one range at once, or ``None`` (then :meth:`try_take`)."""
        allocator = self._tags.get(tag)
        return None if allocator is None else allocator.try_run(count)

    async def take(self, tag: str, count: int, deadline: float) -> IdBatch:
        """IDs of ``tag``, learning the tag and waiting for a segment as needed (until ``deadline``).

        Raises:
            UnknownTag: the store has no such tag.
            StoreUnavailable: the store could not supply a segment before the deadline.
        """
        allocator = await self.resolve(tag, deadline)
        return await allocator.take(count, deadline)

    async def resolve(self, tag: str, deadline: float | None = None) -> TagAllocator | DailyTag[TagAllocator]:
        """The tag's allocator, looking the tag list up once if the tag is not known yet.

        Lookups for unknown tags are at most one per ``unknown_tag_refresh_interval``. A request that finds
        the last one too recent waits for the next (if its ``deadline``, monotonic seconds, allows) rather
        than failing: a tag added a moment after someone else's miss is served, not answered unknown.

        Raises:
            UnknownTag: the store has no such tag.
            StoreUnavailable: the tag is not known and the store cannot be asked.
        """
        allocator = self._tags.get(tag) or self.daily.tags.get(tag)
        if allocator is not None:
            return allocator
        next_lookup = self._last_refresh + self.settings.unknown_tag_refresh_interval
        wait = next_lookup - self._clock.monotonic()
        if wait > 0:
            if deadline is None or self._clock.monotonic() + wait > deadline:
                raise UnknownTag(tag)
            await self._clock.sleep(wait)
            allocator = self._tags.get(tag) or self.daily.tags.get(
                tag
            )  # someone else's lookup may have found it
            if allocator is not None:
                return allocator
            # Our turn, even if a timer fired a hair early (asyncio allows its clock's resolution): the
            # waiters that woke together share this one query.
            await self._refresh_by(deadline)
        elif self._clock.monotonic() - self._last_refresh >= self.settings.unknown_tag_refresh_interval:
            await self._refresh_by(deadline)
        allocator = self._tags.get(tag) or self.daily.tags.get(tag)
        if allocator is not None:
            return allocator
        raise UnknownTag(tag)

    async def refresh(self) -> None:
        """Reload the tag list now (concurrent callers share one query)."""
        task = self._refreshing
        if task is None:
            task = self._refreshing = asyncio.create_task(self._refresh())
            task.add_done_callback(self._refreshed)
        await asyncio.shield(task)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        # Cleared when the lookup ends, not when a caller stops waiting (one past its deadline may leave).
        if self._refreshing is task:
            self._refreshing = None
        if not task.cancelled():
            task.exception()  # retrieved here: a lookup nobody waits for any more is not an unhandled error

    async def _refresh_by(self, deadline: float | None) -> None:
        """:meth:`refresh`, waiting no later than ``deadline`` (monotonic seconds; None: no limit).

        A store that accepts connections and never answers (a hung host, at start or mid-failover) would
        otherwise hold the request for the connect timeout. The lookup itself goes on for those that come next.

        Raises:
            StoreUnavailable: the lookup did not finish by ``deadline``.
        """
        if deadline is None:
            await self.refresh()
            return
        try:
            await run_within(self._clock, self.refresh(), deadline - self._clock.monotonic())
        except TimeoutError:
            raise StoreUnavailable("the tag list could not be read before the request's deadline") from None

    async def _refresh(self) -> None:
        infos = await self._store.list_tags()
        self._last_refresh = self._clock.monotonic()
        seen = set()
        for info in infos:
            seen.add(info.tag)
            if info.daily is not None or info.tag in self.daily.tags:
                plain = self._tags.pop(info.tag, None)
                if plain is not None:  # removed and added again as a daily tag between two refreshes
                    await plain.close(UnknownTag(info.tag))
                    self._release(info.tag)
                if await self.daily.refresh(info):
                    continue
            allocator = self._tags.get(info.tag)
            if allocator is None:
                self._tags[info.tag] = TagAllocator(
                    info.tag,
                    self._store,
                    self._clock,
                    self.settings,
                    step=info.step,
                    on_unknown=self._forget,
                    sizer=self._sizer,
                    meter=self._meters(info.tag) if self._meters is not None else None,
                    check=self._check,
                )
                log.info("tag %r appeared (step %d)", info.tag, info.step)
            else:
                allocator.step = info.step
        for tag in [t for t in self._tags if t not in seen]:
            log.info("tag %r was removed from the store", tag)
            await self._tags.pop(tag).close(UnknownTag(tag))
            self._release(tag)
        await self.daily.keep(seen)

    def _day_allocator(self, tag: str, name: str, step: int, sizer: Sizer) -> TagAllocator:
        """An allocator of daily tag ``tag``'s day row ``name``: the tag's meter across days, no residue."""
        return TagAllocator(
            name,
            self._store,
            self._clock,
            self.settings,
            step=step,
            on_unknown=lambda _name: self.daily.forget(tag),
            sizer=sizer,
            meter=self._meters(tag) if self._meters is not None else None,
        )

    def _forget(self, tag: str) -> None:
        # The store said the tag is gone while we fetched: drop it now rather than at the next refresh.
        if self._tags.pop(tag, None) is not None:
            log.info("forgetting tag %r until its next lookup", tag)
            self._release(tag)

    def _release(self, tag: str) -> None:
        if self._check is not None:
            self._check.release(tag)

    async def run_refresh_loop(self) -> None:
        """Refresh the tag list every ``refresh_interval`` seconds, until cancelled."""
        while True:
            await self._clock.sleep(self.settings.refresh_interval)
            try:
                await self.refresh()
            except DispenserError as exc:
                log.warning("tag refresh failed, keeping the %d known tags: %s", len(self._tags), exc)

    async def close(self) -> None:
        """Stop every fetch."""
        for allocator in self._tags.values():
            await allocator.close()
        await self.daily.close()
