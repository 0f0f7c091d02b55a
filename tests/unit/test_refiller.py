"""The one refill shell on virtual time, run against both of its sources: the worker's store, the client's workers.

Each rig builds the real owner (a worker's :class:`TagAllocator` over the memory store, an :class:`IdClient`
over a memory fleet) and drives its :class:`~dispenser.service.refiller.Refiller`. Waits, back-offs and
absences ("no retry storm") are exact: nothing moves but the ManualClock, and the back-off's jitter is 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from dispenser.client import BufferSettings, IdClient
from dispenser.core.ids import Range
from dispenser.core.refill import Phase, Refill
from dispenser.messages import ErrorBody, IdRequest, Kind, Reply
from dispenser.ports import Allocation
from dispenser.service.refiller import Refiller
from dispenser.service.segments import AllocatorSettings, TagAllocator
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemorySegmentStore

STEP = 100
"""The size of a range asked for at no load: the worker's configured step, the client's min_buffer."""


class Store(MemorySegmentStore):
    """The memory store, recording the sizes asked for; ``gate`` holds fetches, ``bug`` raises a KeyError."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int | None] = []
        self.gate: asyncio.Event | None = None
        self.bug = False

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        self.asked.append(step)
        if self.gate is not None:
            await self.gate.wait()
        if self.bug:
            raise KeyError("a bug")
        return await super().next_segment(tag, step, above=above)


class Fleet:
    """Workers in memory: ranges from one counter, replayed by ``request_id``; ``down``, ``bug``, ``refuse``."""

    def __init__(self) -> None:
        self.position = 1
        self.requests: list[IdRequest] = []
        self.answers: dict[str, Reply] = {}
        self.gate: asyncio.Event | None = None
        self.down = False
        self.bug = False
        self.refuse: ErrorBody | None = None

    async def start(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to close."""

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Ranges, a replay, or the failure the test set."""
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if self.bug:
            raise KeyError("a bug")
        if self.down:
            raise ConnectionError(f"no dispenser is serving leaf.{kind}.{tag}")
        if self.refuse is not None:
            return Reply(tag=tag, error=self.refuse)
        assert request.request_id is not None
        reply = self.answers.get(request.request_id)
        if reply is None:
            first = self.position
            self.position += request.count
            reply = Reply(tag=tag, ranges=[(first, first + request.count - 1)], request_id=request.request_id)
            self.answers[request.request_id] = reply
        return reply


@dataclass
class Rig:
    """One owner's refiller, and the switches of its source."""

    clock: ManualClock
    engine: Refill
    refiller: Refiller
    asked: Callable[[], list[int | None]]
    """The sizes asked for, one per attempt."""
    request_ids: Callable[[], list[str | None]]
    """The client's request_id per attempt (the worker's store has none: ``[]``)."""
    take: Callable[[int], Awaitable[list[Range]]]
    """The owner's own take (waits for the refill)."""
    down: Callable[[bool], None]
    bug: Callable[[bool], None]
    refuse: Callable[[], Awaitable[None]]
    """Make the source refuse for good (the tag gone)."""
    step: Callable[[int], None]
    """Make the source's step this size."""
    gate: Callable[[asyncio.Event], None]
    """Hold every attempt until the event is set."""


async def worker_rig(clock: ManualClock) -> Rig:
    """A worker's tag over the memory store (step 100)."""
    store = Store()
    await store.add_tag("t", STEP)
    settings = AllocatorSettings(retry_initial=0.05, retry_max=0.4)
    allocator = TagAllocator("t", store, clock, settings, step=STEP)
    refiller = allocator._refiller
    refiller.jitter = 0.0

    async def take(count: int) -> list[Range]:
        return list((await allocator.take(count, clock.monotonic() + 1.0)).ranges)

    def step(size: int) -> None:
        allocator.step = size

    def gate(event: asyncio.Event) -> None:
        store.gate = event

    def bug(on: bool) -> None:
        store.bug = on

    async def refuse() -> None:
        await store.remove_tag("t")

    return Rig(
        clock,
        allocator.refill,
        refiller,
        asked=lambda: store.asked,
        request_ids=list,
        take=take,
        down=store.set_unavailable,
        bug=bug,
        refuse=refuse,
        step=step,
        gate=gate,
    )


async def client_rig(clock: ManualClock) -> Rig:
    """A client's tag over a memory fleet (min_buffer 100)."""
    fleet = Fleet()
    settings = BufferSettings(
        min_buffer=STEP, max_buffer=1000, retry_initial=0.05, retry_max=0.4, timeout=1.0
    )
    client = IdClient(fleet, settings, clock=clock)
    state = client._state("t")
    state.refiller.jitter = 0.0

    async def take(count: int) -> list[Range]:
        return await client.take("t", count, format="ranges")

    def step(size: int) -> None:
        client.settings = dataclasses.replace(client.settings, min_buffer=size)

    def gate(event: asyncio.Event) -> None:
        fleet.gate = event

    def down(on: bool) -> None:
        fleet.down = on

    def bug(on: bool) -> None:
        fleet.bug = on

    async def refuse() -> None:
        fleet.refuse = ErrorBody("unknown_tag", "unknown tag 't'", retryable=False)

    return Rig(
        clock,
        state.engine,
        state.refiller,
        asked=lambda: [r.count for r in fleet.requests],
        request_ids=lambda: [r.request_id for r in fleet.requests],
        take=take,
        down=down,
        bug=bug,
        refuse=refuse,
        step=step,
        gate=gate,
    )


RIGS = {"worker": worker_rig, "client": client_rig}


@pytest.fixture(params=sorted(RIGS))
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """The refiller of a worker's tag or of a client's, on a manual clock (back-off 0.05 s doubling to 0.4 s)."""
    built = await RIGS[request.param](ManualClock())
    yield built
    await built.refiller.close()


async def test_waiters_share_one_fetch(rig: Rig) -> None:
    """Fifty takes on an empty buffer: one attempt, then each its own IDs."""
    held = asyncio.Event()
    rig.gate(held)
    takes = [asyncio.ensure_future(rig.take(1)) for _ in range(50)]
    await settle()
    assert len(rig.asked()) == 1
    held.set()
    ids = [first for ranges in await asyncio.gather(*takes) for first, _ in ranges]
    assert sorted(ids) == list(range(1, 51))
    assert len(rig.asked()) <= 2  # the first range, maybe the prefetch of the next


async def test_a_wait_ends_at_its_deadline_to_the_millisecond(rig: Rig) -> None:
    """Nothing changes: the wait ends at its deadline of virtual time, not a moment before."""
    rig.gate(asyncio.Event())
    rig.refiller.kick()
    waiting = asyncio.ensure_future(rig.refiller.wait(rig.clock.monotonic() + 0.5))
    await rig.clock.advance(0.499)
    assert not waiting.done()
    await rig.clock.advance(0.002)
    assert waiting.done()
    assert await waiting is False


async def test_the_retries_back_off_exactly_no_storm(rig: Rig) -> None:
    """Source down: attempts at 0, 0.05, 0.15, 0.35, 0.75, 1.15 s (the cap, 0.4 s, from then on), no more."""
    rig.down(True)
    rig.refiller.kick()
    await rig.clock.advance(0.349)
    assert len(rig.asked()) == 3
    await rig.clock.advance(0.002)
    assert len(rig.asked()) == 4
    await rig.clock.advance(0.798)  # 1.149 s in all
    assert len(rig.asked()) == 5
    assert rig.engine.phase is Phase.BACKING_OFF
    await rig.clock.advance(0.002)
    assert len(rig.asked()) == 6
    await rig.clock.advance(0.398)
    assert len(rig.asked()) == 6


async def test_an_outage_is_one_warning_then_one_recovery_line(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """First failure at WARNING, the retries at DEBUG, one INFO when answered; meanwhile the failure is known."""
    logger = rig.refiller.source.log.name
    caplog.set_level(logging.DEBUG, logger=logger)
    rig.down(True)
    rig.refiller.kick()
    await rig.clock.advance(1.0)
    assert rig.refiller.failure is not None
    assert rig.refiller.failures == len(rig.asked()) == 5
    rig.down(False)
    await rig.clock.advance(0.4)
    assert rig.refiller.failure is None
    assert rig.engine.remaining == STEP
    levels = [r.levelno for r in caplog.records if r.name == logger]
    assert levels == [logging.WARNING] + [logging.DEBUG] * 4 + [logging.INFO]
    assert "recovered after 5 failed attempt(s) in 1.1 s" in caplog.records[-1].getMessage()


async def test_a_retry_repeats_the_request_or_is_sized_anew(rig: Rig) -> None:
    """The client's retry asks what failed, by its request_id (it may be granted); the worker's re-sizes."""
    rig.down(True)
    rig.refiller.kick()
    await settle()
    rig.step(500)
    await rig.clock.advance(0.06)
    ids = rig.request_ids()
    if ids:  # the client
        assert rig.asked()[:2] == [STEP, STEP]
        assert ids[0] == ids[1]
    else:
        assert rig.asked()[:2] == [STEP, 500]


async def test_a_bug_is_logged_with_its_traceback_and_retried(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Not an outage: the traceback, an error for the waiters, and a retry that gets through."""
    rig.bug(True)
    rig.refiller.kick()
    await settle()
    assert "failed unexpectedly" in caplog.text
    assert "KeyError" in str(rig.refiller.failure)
    rig.bug(False)
    await rig.clock.advance(0.05)
    assert rig.engine.remaining == STEP
    assert rig.refiller.task is None


async def test_a_refusal_ends_the_fetch_and_no_attempt_follows(rig: Rig) -> None:
    """No retry for a refusal: its error is known at once, and no attempt follows in 5 s."""
    await rig.refuse()
    rig.engine.need(1)
    rig.refiller.kick()
    await settle()
    assert rig.refiller.refused is not None
    assert rig.refiller.task is None
    await rig.clock.advance(5.0)
    assert len(rig.asked()) == 1
    assert rig.engine.phase is Phase.IDLE
    assert rig.engine.wanted == 0


async def test_a_take_bigger_than_a_range_is_fetched_again_at_once(rig: Rig) -> None:
    """A take of 250 comes while a range of 100 is asked for: that range, then at once one for the rest."""
    held = asyncio.Event()
    rig.gate(held)
    small = asyncio.ensure_future(rig.take(1))
    await settle()
    big = asyncio.ensure_future(rig.take(250))
    await settle()
    held.set()
    ranges = await big
    assert sum(b - a + 1 for a, b in ranges) == 250
    assert (await small)[0][0] not in {i for a, b in ranges for i in range(a, b + 1)}
    assert rig.asked()[:2] == [STEP, 150]


async def test_close_cancels_the_fetch_and_none_begins_after(rig: Rig) -> None:
    """Closed mid-flight: the engine is idle again and a kick starts nothing."""
    rig.gate(asyncio.Event())
    rig.refiller.kick()
    await settle()
    await rig.refiller.close()
    assert rig.refiller.task is None
    assert rig.engine.phase is Phase.IDLE
    rig.refiller.kick()
    assert rig.refiller.task is None
    assert len(rig.asked()) == 1
