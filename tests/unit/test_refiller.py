"""The one refill shell, on virtual time, against a store-like source and a transport-like one.

Both sources grant from counters the test controls; each can be made to fail. The waits, back-offs and
absences ("no retry storm") are exact: nothing moves but the ManualClock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from dispenser.core.errors import StoreUnavailable, UnknownTag
from dispenser.core.rate import RateMeter
from dispenser.core.refill import Again, Done, Fetch, Overlap, Phase, Refill, Stop
from dispenser.core.segment import NEED_SEGMENT
from dispenser.service.refiller import Refiller, Refused
from dispenser.testing.clock import ManualClock, settle

log = logging.getLogger("tests.refiller")


@dataclass
class Source:
    """Grants ``size`` IDs from a counter; ``down`` fails every attempt, ``refuse`` ends the fetch."""

    overlap: Overlap
    step_size: int = 100
    counter: int = 1
    down: bool = False
    bug: bool = False
    refuse: Exception | None = None
    gate: asyncio.Event | None = None
    attempts: list[Fetch] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    outcomes: list[Done | Again] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    log: logging.Logger = log
    subject: str = "refill of 't'"
    peer: str = "a source"
    outages: tuple[type[Exception], ...] = (StoreUnavailable,)

    def step(self) -> int | None:
        return self.step_size

    def outside(self) -> int:
        return 0

    async def fetch(self, fetch: Fetch) -> Sequence[tuple[int, int]]:
        self.attempts.append(fetch)
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse is not None:
            raise Refused(self.refuse)
        if self.bug:
            raise KeyError("a bug")
        if self.down:
            raise StoreUnavailable("down")
        size = fetch.size or self.step_size
        first = self.counter
        self.counter += size
        return [(first, first + size - 1)]

    def unexpected(self, exc: Exception) -> Exception:
        return StoreUnavailable(f"unexpected {type(exc).__name__}")

    def failed(self, error: Exception) -> None:
        self.errors.append(error)

    def arrived(self, outcome: Done | Again) -> None:
        self.outcomes.append(outcome)

    def stopped(self, stop: Stop) -> None:
        self.stops.append(stop)


SOURCES = {
    "store": {"overlap": Overlap.REFUSE, "repeat_on_retry": False},
    "transport": {"overlap": Overlap.SKIP, "repeat_on_retry": True},
}


@dataclass
class Rig:
    clock: ManualClock
    source: Source
    engine: Refill
    refiller: Refiller

    async def take(self, count: int, deadline: float) -> list[tuple[int, int]]:
        """What a shell's take does: take, or need, kick and wait (until ``deadline``)."""
        engine, refiller = self.engine, self.refiller
        while True:
            batch = engine.take(count, self.clock.monotonic())
            if engine.wants_fetch:
                refiller.kick()
            if batch is not NEED_SEGMENT:
                return list(batch.ranges)
            engine.need(count)
            refiller.kick()
            if not await refiller.wait(deadline):
                raise TimeoutError
            if refiller.refused is not None:
                raise refiller.refused


@pytest.fixture(params=sorted(SOURCES))
def rig(request: pytest.FixtureRequest) -> Rig:
    """A refiller over one kind of source, on a manual clock (retries from 0.05 s, doubling up to 0.4 s, no jitter)."""
    kind = SOURCES[request.param]
    clock = ManualClock()
    source = Source(kind["overlap"])  # type: ignore[arg-type]
    engine = Refill(
        RateMeter(clock.monotonic()),
        overlap=kind["overlap"],  # type: ignore[arg-type]
        repeat_on_retry=kind["repeat_on_retry"],  # type: ignore[arg-type]
    )
    refiller = Refiller(engine, source, clock, retry_initial=0.05, retry_max=0.4, name="refill-t", jitter=0.0)
    return Rig(clock, source, engine, refiller)


async def test_waiters_share_one_fetch(rig: Rig) -> None:
    """Fifty takes on an empty buffer: one attempt, then each its own IDs."""
    rig.source.gate = asyncio.Event()
    deadline = rig.clock.monotonic() + 1.0
    takes = [asyncio.ensure_future(rig.take(1, deadline)) for _ in range(50)]
    await settle()
    assert len(rig.source.attempts) == 1
    rig.source.gate.set()
    ids = [first for ranges in await asyncio.gather(*takes) for first, _ in ranges]
    assert sorted(ids) == list(range(1, 51))
    assert len(rig.source.attempts) <= 2  # the first range, maybe the prefetch of the next


async def test_a_wait_ends_at_its_deadline_and_the_retries_back_off_exactly(rig: Rig) -> None:
    """Source down: the take fails at its deadline, not before; attempts at 0, 0.05, 0.15, 0.35, 0.75, 1.15 s: no storm."""
    rig.source.down = True
    start = rig.clock.monotonic()
    take = asyncio.ensure_future(rig.take(1, start + 0.5))
    await rig.clock.advance(0.499)
    assert not take.done()
    await rig.clock.advance(0.002)
    with pytest.raises(TimeoutError):
        await take
    assert len(rig.source.attempts) == 4
    await rig.clock.advance(0.648)  # 1.149 s in all
    assert len(rig.source.attempts) == 5
    assert rig.engine.phase is Phase.BACKING_OFF
    await rig.clock.advance(0.002)
    assert len(rig.source.attempts) == 6  # the cap: 0.4 s apart from now on


async def test_an_outage_is_one_warning_then_one_recovery_line(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """First failure at WARNING, the retries at DEBUG, one INFO when it is answered; waiters see the error."""
    caplog.set_level(logging.DEBUG, logger=log.name)
    rig.source.down = True
    rig.refiller.kick()
    await rig.clock.advance(1.0)
    assert isinstance(rig.refiller.failure, StoreUnavailable)
    assert rig.refiller.failures == len(rig.source.attempts) >= 4
    rig.source.down = False
    await rig.clock.advance(0.5)
    assert rig.refiller.failure is None
    assert rig.engine.remaining == 100
    levels = [(r.levelno, r.getMessage().split(" ", 4)[-1][:25]) for r in caplog.records]
    assert [lv for lv, _ in levels].count(logging.WARNING) == 1
    assert [lv for lv, _ in levels].count(logging.INFO) == 1
    assert "recovered after" in caplog.records[-1].getMessage()
    assert all(isinstance(e, StoreUnavailable) for e in rig.source.errors)


async def test_a_retry_repeats_the_request_or_is_sized_anew(rig: Rig) -> None:
    """The transport's retry asks exactly what failed (its request_id may be granted); the store's re-sizes."""
    rig.source.down = True
    rig.refiller.kick()
    await settle()
    rig.source.step_size = 500
    await rig.clock.advance(0.06)
    first, retry = rig.source.attempts[:2]
    assert first.size == 100
    if rig.engine.repeat_on_retry:
        assert (retry.size, retry.repeat) == (100, True)
    else:
        assert (retry.size, retry.repeat) == (500, False)


async def test_a_bug_is_logged_with_its_traceback_and_retried(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Not an outage: the traceback, the error waiters see, and a retry that gets through."""
    rig.source.bug = True
    rig.refiller.kick()
    await settle()
    assert "failed unexpectedly" in caplog.text
    assert "unexpected KeyError" in str(rig.refiller.failure)
    rig.source.bug = False
    await rig.clock.advance(0.1)
    assert rig.engine.remaining == 100
    assert rig.refiller.task is None


async def test_a_refusal_ends_the_fetch_and_the_waits_with_its_error(rig: Rig) -> None:
    """No retry for a refusal: the waiters get its error at once, and no attempt follows."""
    rig.source.refuse = UnknownTag("t")
    with pytest.raises(UnknownTag):
        await rig.take(1, rig.clock.monotonic() + 1.0)
    await rig.clock.advance(5.0)
    assert len(rig.source.attempts) == 1
    assert rig.engine.phase is Phase.IDLE
    assert rig.engine.wanted == 0


async def test_a_take_bigger_than_a_range_is_fetched_again_at_once(rig: Rig) -> None:
    """A take of 250 comes while a range of 100 is asked for: that range, then at once one for the rest."""
    rig.source.gate = asyncio.Event()
    deadline = rig.clock.monotonic() + 1.0
    small = asyncio.ensure_future(rig.take(1, deadline))
    await settle()
    big = asyncio.ensure_future(rig.take(250, deadline))
    await settle()
    rig.source.gate.set()
    ranges = await big
    assert sum(b - a + 1 for a, b in ranges) == 250
    assert (await small)[0][0] not in {i for a, b in ranges for i in range(a, b + 1)}
    assert [a.size for a in rig.source.attempts[:2]] == [100, 150]
    assert isinstance(rig.source.outcomes[0], Again)


async def test_close_cancels_the_fetch_and_none_begins_after(rig: Rig) -> None:
    """Closed mid-flight: the engine is idle again and a kick starts nothing."""
    rig.source.gate = asyncio.Event()
    rig.refiller.kick()
    await settle()
    await rig.refiller.close()
    assert rig.refiller.task is None
    assert rig.engine.phase is Phase.IDLE
    rig.refiller.kick()
    assert rig.refiller.task is None
    assert len(rig.source.attempts) == 1
