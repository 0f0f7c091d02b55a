"""The refill engine both the worker and the client drive: measured on a ManualClock, and its properties."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.rate import RateMeter
from dispenser.core.refill import (
    IDLE,
    RETRY,
    Again,
    Done,
    Fetch,
    Overlap,
    Phase,
    Refill,
    RefillOrderError,
    Stop,
)
from dispenser.core.segment import NEED_SEGMENT
from dispenser.core.step import StepPolicy
from dispenser.testing.clock import ManualClock


def engine(
    clock: ManualClock,
    *,
    min_gap: float = 0.1,
    overlap: Overlap = Overlap.REFUSE,
    repeat_on_retry: bool = False,
) -> Refill:
    return Refill(
        RateMeter(clock.monotonic()), min_gap=min_gap, overlap=overlap, repeat_on_retry=repeat_on_retry
    )


def fixed(step: int | None) -> Callable[[], int | None]:
    """A step policy that always answers ``step``."""
    return lambda: step


def sent(refill: Refill, now: float, step: int | None = None) -> Fetch:
    """Open a fetch and send its first attempt."""
    refill.begin()
    fetch = refill.next(now, fixed(step))
    assert isinstance(fetch, Fetch)
    return fetch


async def test_the_rate_is_measured_between_attempts_and_never_over_less_than_min_gap() -> None:
    """1,000 IDs in 0.5 s read 2,000/s; the same 1,000 in 1 ms read as if spread over min_gap, never 1M/s."""
    clock = ManualClock()
    refill = engine(clock)
    assert refill.recent_rate(clock.monotonic()) == 0.0  # no attempt yet: nothing measured
    sent(refill, clock.monotonic(), 10_000)
    assert isinstance(refill.on_reply([(1, 10_000)], clock.monotonic()), Done)
    await clock.advance(0.5)
    assert refill.take(1000, clock.monotonic()) is not NEED_SEGMENT
    assert refill.recent_rate(clock.monotonic()) == pytest.approx(2000.0)

    sent(refill, clock.monotonic())
    await clock.advance(0.001)
    assert refill.take(1000, clock.monotonic()) is not NEED_SEGMENT
    assert refill.recent_rate(clock.monotonic()) == pytest.approx(1000 / 0.1)


async def test_a_retry_moves_the_mark_and_a_fetch_for_a_waiter_measures_nothing() -> None:
    """An outage's wait is not counted as consumption; a fetch paced by a take, not by consumption, has no rate."""
    clock = ManualClock()
    refill = engine(clock)
    sent(refill, clock.monotonic())
    assert refill.on_failure() is RETRY
    await clock.advance(5.0)  # the source is down for 5 s
    assert refill.next(clock.monotonic(), fixed(100)) == Fetch(100)
    assert isinstance(refill.on_reply([(1, 100)], clock.monotonic()), Done)
    await clock.advance(1.0)
    refill.take(100, clock.monotonic())
    assert refill.recent_rate(clock.monotonic()) == pytest.approx(100.0)  # over 1 s, not 6

    refill.need(500)
    sent(refill, clock.monotonic(), 200)
    again = refill.on_reply([(101, 300)], clock.monotonic())
    assert isinstance(again, Again)
    assert not again.pause
    assert refill.buffer.fetching
    assert refill.recent_rate(clock.monotonic()) == 0.0
    assert refill.size(100) == 300  # the shortfall, above the step
    assert refill.next(clock.monotonic(), fixed(100)) == Fetch(300)
    assert isinstance(refill.on_reply([(301, 600)], clock.monotonic()), Done)
    assert refill.wanted == 0
    assert refill.size(100) == 100


async def test_overlap_is_refused_from_one_source_and_skipped_from_several() -> None:
    """The worker's store grants increasing segments (an overlap is a fault); two workers may be apart."""
    clock = ManualClock()
    strict = engine(clock)
    sent(strict, clock.monotonic())
    strict.on_reply([(1, 100)], clock.monotonic())
    sent(strict, clock.monotonic())
    stop = strict.on_reply([(50, 150)], clock.monotonic())
    assert isinstance(stop, Stop)
    assert "not above" in stop.reason
    assert not strict.buffer.fetching
    assert strict.phase is Phase.IDLE

    lenient = engine(clock, overlap=Overlap.SKIP)
    sent(lenient, clock.monotonic())
    lenient.on_reply([(1, 100)], clock.monotonic())
    sent(lenient, clock.monotonic())
    done = lenient.on_reply([(50, 150)], clock.monotonic())
    assert isinstance(done, Done)
    arrival = done.arrival
    assert (arrival.received, arrival.dropped, arrival.admitted) == (101, 51, 50)
    sent(lenient, clock.monotonic())
    behind = lenient.on_reply([(1, 20)], clock.monotonic())
    assert isinstance(behind, Again)
    assert behind.arrival.admitted == 0
    assert lenient.buffer.fetching  # nothing arrived: the fetch goes on


async def test_a_refusal_ends_the_fetch_and_the_wait() -> None:
    clock = ManualClock()
    refill = engine(clock)
    refill.need(10)
    sent(refill, clock.monotonic())
    assert isinstance(refill.on_failure(final=True), Stop)
    assert not refill.buffer.fetching
    assert refill.wanted == 0
    assert refill.next(clock.monotonic()) is IDLE


async def test_decisions_out_of_turn_are_refused() -> None:
    """The call order is the engine's state: one fetch at a time, a reply only to an attempt out."""
    clock = ManualClock()
    refill = engine(clock)
    assert refill.next(clock.monotonic()) is IDLE  # nothing open: nothing to send
    with pytest.raises(RefillOrderError, match="on_reply"):
        refill.on_reply([(1, 10)], clock.monotonic())
    with pytest.raises(RefillOrderError, match="on_failure"):
        refill.on_failure()
    sent(refill, clock.monotonic())
    with pytest.raises(RefillOrderError, match="begin"):
        refill.begin()  # a second fetch while one is open
    with pytest.raises(RefillOrderError, match="next"):
        refill.next(clock.monotonic())  # an attempt is out
    refill.on_failure()
    with pytest.raises(RefillOrderError, match="on_reply"):
        refill.on_reply([(1, 10)], clock.monotonic())  # backing off: nothing is out
    refill.abandon()
    assert refill.phase is Phase.IDLE
    assert not refill.buffer.fetching


async def test_a_retry_repeats_the_failed_request_or_is_sized_anew() -> None:
    """The client's retry asks what it asked (its request_id may be granted already); the worker's re-sizes."""
    clock = ManualClock()
    for repeat, expected in ((True, Fetch(100, repeat=True)), (False, Fetch(500))):
        refill = engine(clock, repeat_on_retry=repeat)
        assert sent(refill, clock.monotonic(), 100) == Fetch(100)
        refill.on_failure()
        assert refill.next(clock.monotonic(), fixed(500)) == expected


def test_the_client_sizes_from_its_own_meter() -> None:
    """A fleet of one: rate and peak are the meter's, and the size is the policy's within floor and cap."""
    meter = RateMeter(0.0, window=1, retention=60.0)
    refill = Refill(meter, overlap=Overlap.SKIP)
    policy = StepPolicy(segment_seconds=3.0, max_step=1_000_000)
    assert refill.step(policy, 100, refill.own_view(0.0)) == 100
    refill.begin()
    refill.next(0.0)  # the attempt marks the start of the measurement
    meter.record(0.5, 50_000)
    view = refill.own_view(0.5)
    assert view.recent == pytest.approx(100_000.0)
    step = refill.step(policy, 100, view)
    assert 300_000 <= step <= 1_000_000
    assert refill.size(step, cap=200_000) == 200_000


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int]]:
    ops = st.one_of(
        st.tuples(st.just("take"), st.integers(1, 300)),
        st.tuples(st.just("run"), st.integers(1, 300)),
        st.tuples(st.just("wait"), st.integers(0, 2000)),
        st.tuples(st.just("reply"), st.integers(0, 2)),
        st.tuples(st.just("fail"), st.just(0)),
    )
    return draw(st.lists(ops, min_size=1, max_size=120))


def hand_out(refill: Refill, op: str, count: int, now: float) -> list[int]:
    """A take (``op == "take"``) or a cursor run of ``count``: the IDs; a short one waits (``need``)."""
    if op == "take":
        batch = refill.take(count, now)
        ranges = () if batch is NEED_SEGMENT else batch.ranges
    else:
        run = refill.take_run(count, now)
        ranges = () if run is NEED_SEGMENT else (run,)
    if not ranges:
        refill.need(count if op == "take" else 1)
    return [i for first, last in ranges for i in range(first, last + 1)]


@given(
    ops=operations(),
    sources=st.integers(1, 3),
    floor=st.integers(1, 200),
    cap=st.integers(200, 5000),
    min_gap=st.sampled_from([0.001, 0.1]),
)
def test_never_an_id_twice_never_below_one_handed_out_and_sizes_within_bounds(
    ops: list[tuple[str, int]], sources: int, floor: int, cap: int, min_gap: float
) -> None:
    """Any mix of takes, runs, time, replies from several sources (each behind or ahead) and failures.

    And no reply installs more than its fetch keeps: the gap asked for to pass a source behind is never held.
    """
    now = 0.0
    refill = Refill(RateMeter(now, window=1, retention=60.0), min_gap=min_gap, overlap=Overlap.SKIP, cap=cap)
    policy = StepPolicy(segment_seconds=3.0, max_step=cap)
    # Each source grants from a counter of its own, as workers holding different segments do.
    counters = [1 + i * 1_000_000 for i in range(sources)]
    turn = itertools.cycle(range(sources))
    handed: list[int] = []
    in_flight: int | None = None
    keep: int | None = None  # what of the reply in flight may be held (without the gap to a source behind)
    steps: list[int] = []  # the policy's answers, as the engine asked for them

    def policy_step() -> int:
        step = refill.step(policy, floor, refill.own_view(now))
        assert floor <= step <= max(floor, cap)
        steps.append(step)
        return step

    def send() -> tuple[int, int | None]:
        fetch = refill.next(now, policy_step)
        assert isinstance(fetch, Fetch)
        assert fetch.size is not None
        return fetch.size, fetch.keep

    for op, arg in ops:
        if op == "wait":
            now += arg / 1000
        elif op in ("take", "run"):
            handed += hand_out(refill, op, arg, now)
        if in_flight is None and (refill.wants_fetch or refill.wanted):
            shortfall = refill.shortfall()
            refill.begin()
            in_flight, keep = send()
            assert min(max(steps[-1], shortfall), cap) == in_flight == keep
        elif in_flight is not None and op == "fail":
            assert refill.on_failure() is RETRY
            in_flight, keep = send()
        elif in_flight is not None and op == "reply":
            source = arg % sources if arg < sources else next(turn)
            first = counters[source]
            counters[source] += in_flight
            held = refill.remaining
            outcome = refill.on_reply([(first, first + in_flight - 1)], now)
            assert not isinstance(outcome, Stop)
            assert outcome.arrival.received == in_flight
            assert refill.remaining - held == outcome.arrival.admitted <= (keep or in_flight)
            in_flight = None
            if isinstance(outcome, Again):
                in_flight, keep = send()
        assert refill.recent_rate(now) <= refill.meter.ids_issued / min_gap
    assert len(handed) == len(set(handed))  # never an ID twice
    assert all(a < b for a, b in itertools.pairwise(handed))  # never one below an ID handed out
    assert refill.meter.ids_issued == len(handed)


def test_a_source_far_behind_is_asked_for_the_whole_gap_and_forgotten_once_passed() -> None:
    """A reply entirely below what is held: the next size covers the gap; an admitted reply clears it."""
    clock = ManualClock()
    refill = engine(clock, overlap=Overlap.SKIP)
    sent(refill, clock.monotonic(), 1000)
    refill.on_reply([(1001, 2000)], clock.monotonic())
    assert refill.size(100) == 100
    sent(refill, clock.monotonic(), 100)
    again = refill.on_reply([(11, 110)], clock.monotonic())
    assert isinstance(again, Again)
    assert (again.arrival.received, again.arrival.dropped) == (100, 100)
    assert refill.behind == 2000 - 110
    assert refill.size(100) == 100 + 1890
    assert refill.size(100, cap=500) == 500
    assert refill.next(clock.monotonic(), fixed(100)) == Fetch(1990, keep=100)
    refill.on_reply([(1901, 3990)], clock.monotonic())
    assert refill.behind == 0
    assert refill.size(100) == 100


@pytest.mark.parametrize("answers", ["ahead", "behind"])
def test_the_gap_to_a_source_behind_is_asked_for_but_never_held(answers: str) -> None:
    """Issue 30: two sources whose segments interleave; what is held stays a range's worth, whoever answers.

    A reply wholly below the IDs held makes the next request ask for the gap on top of the step (to pass a
    source far behind in one request). Answered by the source ahead, the whole of it lay above the IDs held
    and was installed: a million IDs held for a step of 100. Now the engine keeps the step's worth of it.
    """
    clock = ManualClock()
    refill = engine(clock, overlap=Overlap.SKIP)
    counters = {"behind": 1, "ahead": 1_000_001}  # two workers' segments

    def reply(source: str, size: int) -> list[tuple[int, int]]:
        first = counters[source]
        counters[source] += size
        return [(first, first + size - 1)]

    for source in ("behind", "ahead"):  # one range from each: both admitted
        fetch = sent(refill, clock.monotonic(), 100)
        assert fetch.size is not None
        assert isinstance(refill.on_reply(reply(source, fetch.size), clock.monotonic()), Done)
    fetch = sent(refill, clock.monotonic(), 100)
    assert fetch.size is not None
    skipped = refill.on_reply(reply("behind", fetch.size), clock.monotonic())  # wholly below: skipped
    assert isinstance(skipped, Again)
    assert skipped.arrival.admitted == 0
    gap = refill.next(clock.monotonic(), fixed(100))
    assert isinstance(gap, Fetch)
    assert gap.size == 100 + refill.behind  # asks for the gap, to pass the source behind in one request
    outcome = refill.on_reply(reply(answers, gap.size), clock.monotonic())
    assert isinstance(outcome, Done)
    assert refill.remaining <= 3 * 100  # three ranges of the step, whoever answered
    assert outcome.arrival.admitted == 100
    assert outcome.arrival.trimmed == (gap.size - 100 if answers == "ahead" else 0)  # a gap, never a repeat
    assert refill.behind == 0
