"""A daily tag on one worker: today's counter row, drawn like any tag, its counters composed into IDs.

The day is the worker's wall clock's date in the tag's zone when it answers. Each day's counter is a row of
the store (``order@20261128``) that every worker draws from, so no ID repeats whichever day two workers'
clocks say (docs/daily.md). The plain tags' path never comes here.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from dispenser.core.daily import DailyPolicy, check_counter, compose, day_tag, day_window
from dispenser.core.errors import DayExhausted, DispenserError, StoreUnavailable, UnknownTag
from dispenser.core.ids import IdBatch
from dispenser.ports import Clock, TagInfo

__all__ = ["DailyTag", "DailyTags", "DayAllocator", "DayOver"]

log = logging.getLogger(__name__)

MIDNIGHT_MARGIN = 2.0
"""Near midnight a fetch is sized for at most this many times the IDs the rest of the day needs at the
current rate (never below the configured step): the day that ends takes no large segment it cannot use."""


class DayAllocator(Protocol):
    """What a daily tag needs of its day row's allocator (:class:`~dispenser.service.segments.TagAllocator`)."""

    tag: str
    step: int | None

    def try_take(self, count: int) -> IdBatch | None:
        """Counters at once, or None."""
        ...

    async def take(self, count: int, deadline: float) -> IdBatch:
        """Counters, waiting for a fetch until ``deadline``."""
        ...

    def consumption_rate(self) -> float:
        """IDs/s handed out lately."""
        ...

    def refuse(self, error: DispenserError) -> None:
        """Hand out nothing more: every take fails with ``error``."""
        ...

    async def close(self, reason: DispenserError | None = None) -> None:
        """Stop fetching."""
        ...


A = TypeVar("A", bound=DayAllocator)
"""The day rows' allocator type."""


class DayOver(StoreUnavailable):
    """The day a request drew from ended under it; the request draws again from the new day."""


class DailyTag(Generic[A]):
    """One daily tag: the allocator of its current day's row, switched at the zone's midnight."""

    def __init__(
        self,
        tag: str,
        policy: DailyPolicy,
        step: int,
        clock: Clock,
        *,
        make: Callable[[str, int, Callable[[A], int]], A],
        sizer: Callable[[A], int] | None = None,
    ) -> None:
        """Serve ``tag`` under ``policy``.

        Args:
            tag: the daily tag's name.
            policy: its width and zone.
            step: its configured step (each day row's floor).
            clock: whose wall time decides the day.
            make: a :class:`TagAllocator` for a day row's name, with its step and the sizer it is to use.
            sizer: the worker's rate-sized step, capped here near midnight.
        """
        self.tag = tag
        self.policy = policy
        self.step = step
        self._clock = clock
        self._make = make
        self._sizer = sizer
        self._start = self._end = (
            0  # the current day's span of wall milliseconds: empty, so the first take looks
        )
        self.day = 0
        """The current day (``YYYYMMDD``; 0 before the first request)."""
        self._base = 0
        self._capacity = policy.capacity
        self.current: A | None = None
        """The current day row's allocator."""
        self._retiring: set[asyncio.Task[None]] = set()

    def try_take(self, count: int) -> IdBatch | None:
        """IDs of today at once, or ``None`` (then :meth:`take`).

        Raises:
            DayExhausted: today's counter has no room for ``count`` more.
            BadRequest: the tag's zone is unknown to this machine.
        """
        now = self._clock.wall_ms()
        if not self._start <= now < self._end:
            self._switch(now)
        allocator = self.current
        assert allocator is not None
        batch = allocator.try_take(count)
        if batch is None:
            return None
        ranges = batch.ranges
        if len(ranges) == 1:  # nearly every request: one range, well inside the day's width
            first, last = ranges[0]
            if last <= self._capacity:
                base = self._base
                return IdBatch(((base + first, base + last),))
        return self._compose(allocator, self.day, self._base, batch)

    async def take(self, count: int, deadline: float) -> IdBatch:
        """IDs of the day the worker's clock says when they are handed out, waiting until ``deadline``.

        A request that waited for a fetch across midnight draws again from the new day (the counters of
        the day that ended are a gap): an ID always carries the date of the moment it was answered.

        Raises:
            DayExhausted: today's counter has no room for ``count`` more.
            StoreUnavailable: no IDs before the deadline.
            UnknownTag: the tag was removed.
        """
        while True:
            now = self._clock.wall_ms()
            if not self._start <= now < self._end:
                self._switch(now)
            allocator, day, base = self.current, self.day, self._base
            assert allocator is not None
            try:
                batch = await allocator.take(count, deadline)
            except DayOver:
                continue
            if self.day != day or not self._start <= self._clock.wall_ms() < self._end:
                continue
            return self._compose(allocator, day, base, batch)

    def _compose(self, allocator: A, day: int, base: int, batch: IdBatch) -> IdBatch:
        ranges = batch.ranges
        if ranges[-1][1] > self._capacity:
            self._exhausted(allocator, day, ranges[-1][1])
        if len(ranges) == 1:
            first, last = ranges[0]
            return IdBatch(((base + first, base + last),))
        return IdBatch(tuple((base + first, base + last) for first, last in ranges))

    def _exhausted(self, allocator: A, day: int, last: int) -> None:
        try:
            check_counter(self.tag, day, last, self.policy)
        except DayExhausted as exc:
            allocator.refuse(exc)  # every later take of the day fails at once, without a fetch
            log.error("%s", exc.message)
            raise

    def _switch(self, now_ms: int) -> None:
        """Read the day at ``now_ms``; a new day gets its row's allocator and the old one is retired."""
        day, self._start, self._end = day_window(now_ms, self.policy.zone)
        if day == self.day:
            return
        old = self.current
        self.current = self._make(day_tag(self.tag, day), self.step, self._size)
        self.day, self._base = day, compose(day, 0, self.policy.width)
        if old is not None:
            self._retire(old)

    def _retire(self, allocator: A) -> None:
        """A day that is over: no more takes from it (its waiters move on), no more fetches."""
        allocator.refuse(DayOver(f"the day of {allocator.tag!r} is over"))
        task = asyncio.ensure_future(allocator.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _size(self, allocator: A) -> int:
        """The worker's rate-sized step, capped near midnight at what the rest of the day can use."""
        step = allocator.step or self.step
        if self._sizer is not None:
            step = self._sizer(allocator)
        left = (self._end - self._clock.wall_ms()) / 1000
        need = math.ceil(allocator.consumption_rate() * max(left, 0.0) * MIDNIGHT_MARGIN)
        return max(allocator.step or self.step, min(step, need))

    def update(self, policy: DailyPolicy, step: int) -> None:
        """The tag list says the policy or step is now this (a new width or zone applies from the next take)."""
        self.step = step
        if self.current is not None:
            self.current.step = step
        if policy != self.policy:
            self.policy = policy
            self._capacity = policy.capacity
            self._start = self._end = self.day = 0  # the next take opens the day's row under the new policy

    async def close(self, reason: DispenserError | None = None) -> None:
        """Stop fetching (the current day's, and the retired ones' still closing)."""
        if self.current is not None:
            await self.current.close(reason)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


class DailyTags(Generic[A]):
    """A worker's daily tags, by name, kept in step with the store's tag list."""

    def __init__(
        self,
        clock: Clock,
        make: Callable[[str, str, int, Callable[[A], int]], A],
        sizer: Callable[[A], int] | None = None,
    ) -> None:
        """Daily tags whose day rows' allocators come from ``make(tag, day row, step, sizer)``."""
        self.tags: dict[str, DailyTag[A]] = {}
        self._clock = clock
        self._make = make
        self._sizer = sizer
        self._closing: set[asyncio.Task[None]] = set()

    async def refresh(self, info: TagInfo) -> bool:
        """Take in ``info`` from the tag list; False when it is not daily (any more: it is closed then)."""
        daily = self.tags.get(info.tag)
        if info.daily is None:
            if daily is not None:
                await self.tags.pop(info.tag).close(UnknownTag(info.tag))
            return False
        if daily is not None:
            daily.update(info.daily, info.step)
            return True
        tag = info.tag
        self.tags[tag] = DailyTag(
            tag,
            info.daily,
            info.step,
            self._clock,
            make=lambda name, step, sizer: self._make(tag, name, step, sizer),
            sizer=self._sizer,
        )
        log.info(
            "daily tag %r appeared (step %d, width %d, %s)",
            tag,
            info.step,
            info.daily.width,
            info.daily.time_zone,
        )
        return True

    def current(self) -> list[tuple[str, A]]:
        """Each daily tag's name with its current day row's allocator (metrics show a daily tag by its name)."""
        return [(tag, daily.current) for tag, daily in self.tags.items() if daily.current is not None]

    async def keep(self, listed: set[str]) -> None:
        """Close the daily tags the tag list no longer has."""
        for tag in [t for t in self.tags if t not in listed]:
            log.info("daily tag %r was removed from the store", tag)
            await self.tags.pop(tag).close(UnknownTag(tag))

    def forget(self, tag: str) -> None:
        """A day row could not be opened: the tag is gone from the store (looked up again on its next request)."""
        daily = self.tags.pop(tag, None)
        if daily is not None:
            log.info("forgetting daily tag %r until its next lookup", tag)
            task = asyncio.ensure_future(daily.close(UnknownTag(tag)))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Stop every fetch."""
        for daily in self.tags.values():
            await daily.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
