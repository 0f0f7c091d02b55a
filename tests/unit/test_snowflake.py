"""The snowflake core: bit layout, ID composition, and the generator's decisions under any clock."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dispenser.core.errors import (
    ClockBehindRecorded,
    ClockMovedBackwards,
    ClockOutOfRange,
    DispenserError,
    InvalidCount,
    InvalidId,
    InvalidLayout,
    WorkerIdOutOfRange,
)
from dispenser.core.snowflake import (
    LEAF_EPOCH_MS,
    Issued,
    SnowflakeLayout,
    SnowflakeState,
    WaitUntil,
    check_startup_clock,
)
from tests.strategies import DATETIME_MAX_MS, clock_moves, layout_fields, request_counts, snowflake_layouts

LEAF = SnowflakeLayout()
NOW = 1_700_000_000_000  # 2023-11-14, inside the default layout
UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def state(
    layout: SnowflakeLayout = LEAF, worker_id: int = 7, /, *, seed: int = 0, **kwargs: int
) -> SnowflakeState:
    """A generator with a seeded rng, so that random starts repeat from run to run."""
    return SnowflakeState(layout, worker_id, rng=random.Random(seed), **kwargs)


def batch(decision: Issued | WaitUntil) -> Issued:
    assert isinstance(decision, Issued), decision
    return decision


def first_sequence(layout: SnowflakeLayout, decision: Issued | WaitUntil) -> int:
    return layout.decompose(batch(decision).ranges[0][0]).sequence


# --- layout -----------------------------------------------------------------------------------------------


@given(st.data())
def test_decompose_inverts_compose(data: st.DataObject) -> None:
    """For any valid layout and in-range fields, decompose(compose(f)) gives f back."""
    layout = data.draw(snowflake_layouts())
    timestamp_ms, worker_id, sequence = data.draw(layout_fields(layout))
    snowflake_id = layout.compose(timestamp_ms, worker_id, sequence)
    assert 0 <= snowflake_id <= layout.max_id < 2**63
    decoded = layout.decompose(snowflake_id)
    assert (decoded.timestamp_ms, decoded.worker_id, decoded.sequence) == (timestamp_ms, worker_id, sequence)


@given(snowflake_layouts())
def test_compose_orders_by_time_first(layout: SnowflakeLayout) -> None:
    """A later millisecond always composes to a larger ID than any worker and sequence of an earlier one."""
    if layout.max_timestamp_ms == layout.epoch_ms:
        return
    early = layout.compose(layout.epoch_ms, layout.max_worker_id, layout.max_sequence)
    assert layout.compose(layout.epoch_ms + 1, 0, 0) == early + 1


def test_default_layout_is_leafs() -> None:
    """The default layout is 41/10/12 bits from Twitter's epoch, and its largest ID is 2**63 - 1."""
    assert (LEAF.timestamp_bits, LEAF.worker_bits, LEAF.sequence_bits) == (41, 10, 12)
    assert LEAF.epoch_ms == LEAF_EPOCH_MS == 1288834974657
    assert (LEAF.max_worker_id, LEAF.max_sequence) == (1023, 4095)
    assert LEAF.max_id == LEAF.compose(LEAF.max_timestamp_ms, 1023, 4095) == 2**63 - 1


def test_default_layout_ends_on_2080_07_10() -> None:
    """The default layout's last millisecond is epoch + 2**41 - 1 ms, on 2080-07-10 (UTC)."""
    assert LEAF.max_timestamp_ms == 1288834974657 + 2**41 - 1
    end = LEAF.end_datetime()
    assert end == UNIX_EPOCH + timedelta(milliseconds=1288834974657 + 2**41 - 1)
    assert end.tzinfo is UTC
    assert end.date() == date(2080, 7, 10)
    assert end == datetime(2080, 7, 10, 17, 30, 30, 208000, tzinfo=UTC)


def test_decode_uses_the_configured_epoch() -> None:
    """The same bits decode to different times under different epochs; ID 0 is the epoch itself."""
    assert LEAF.decompose(0).datetime == datetime(2010, 11, 4, 1, 42, 54, 657000, tzinfo=UTC)
    other = SnowflakeLayout(epoch_ms=0)
    assert other.decompose(0).datetime == UNIX_EPOCH
    snowflake_id = LEAF.compose(NOW, 5, 6)
    assert other.decompose(snowflake_id).timestamp_ms == NOW - LEAF_EPOCH_MS


@pytest.mark.parametrize(
    ("timestamp_bits", "worker_bits", "sequence_bits"),
    [(42, 10, 12), (41, 11, 12), (41, 10, 13), (1, 1, 62), (64, 0, 0)],
)
def test_layout_over_63_bits_is_refused(timestamp_bits: int, worker_bits: int, sequence_bits: int) -> None:
    """A layout whose fields need more than 63 bits (reaching the sign bit) is refused with a ValueError."""
    with pytest.raises(InvalidLayout, match="over the 63 bits") as caught:
        SnowflakeLayout(
            timestamp_bits=timestamp_bits, worker_bits=worker_bits, sequence_bits=sequence_bits, epoch_ms=0
        )
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "fields",
    [
        {"timestamp_bits": 0},
        {"worker_bits": -1},
        {"sequence_bits": -1},
        {"epoch_ms": -1},
        {"timestamp_bits": 48},  # 2**48 ms from 2010 ends after 9999
        {"worker_bits": True},
    ],
)
def test_layout_with_a_bad_field_is_refused(fields: dict[str, int]) -> None:
    """Empty timestamp, negative widths, an epoch before 1970, an end past 9999 and non-ints are refused."""
    with pytest.raises(InvalidLayout):
        SnowflakeLayout(**fields)


def test_widest_timestamp_that_ends_before_9999_is_accepted() -> None:
    """A layout may end exactly on the last millisecond of 9999, and not one millisecond later."""
    bits = 47
    epoch = DATETIME_MAX_MS - 2**bits + 1
    layout = SnowflakeLayout(timestamp_bits=bits, worker_bits=0, sequence_bits=16, epoch_ms=epoch)
    assert layout.end_datetime() == datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    with pytest.raises(InvalidLayout, match="9999"):
        SnowflakeLayout(timestamp_bits=bits, worker_bits=0, sequence_bits=16, epoch_ms=epoch + 1)


def test_compose_refuses_fields_that_do_not_fit() -> None:
    """Compose refuses a time outside the layout, a worker id or a sequence too wide for its field."""
    with pytest.raises(ClockOutOfRange, match="before the layout's epoch"):
        LEAF.compose(LEAF_EPOCH_MS - 1, 0, 0)
    with pytest.raises(ClockOutOfRange, match="past the layout's last millisecond"):
        LEAF.compose(LEAF.max_timestamp_ms + 1, 0, 0)
    with pytest.raises(WorkerIdOutOfRange):
        LEAF.compose(NOW, 1024, 0)
    with pytest.raises(ValueError, match="sequence 4096"):
        LEAF.compose(NOW, 0, 4096)


@pytest.mark.parametrize("value", [-1, 2**63, 2**64 - 1])
def test_decompose_refuses_numbers_outside_the_layout(value: int) -> None:
    """Decoding a negative number or one wider than 63 bits is a bad request, not a garbage answer."""
    with pytest.raises(InvalidId) as caught:
        LEAF.decompose(value)
    assert isinstance(caught.value, ValueError)


def test_narrow_layout_refuses_ids_wider_than_its_bits() -> None:
    """A 40-bit layout's decoder refuses an ID with bit 40 set."""
    layout = SnowflakeLayout(timestamp_bits=30, worker_bits=4, sequence_bits=6, epoch_ms=0)
    assert layout.decompose(2**40 - 1).sequence == 63
    with pytest.raises(InvalidId):
        layout.decompose(2**40)


# --- generator: sequence start, overflow, batches -------------------------------------------------------


def test_each_millisecond_starts_at_a_random_sequence_below_100() -> None:
    """The first sequence of each new millisecond is drawn from [0, 100), and not always the same."""
    gen = state(seed=1)
    starts = [first_sequence(LEAF, gen.issue(NOW + i, 1)) for i in range(500)]
    assert all(0 <= s < 100 for s in starts)
    assert len(set(starts)) > 50


def test_random_start_comes_from_the_injected_rng() -> None:
    """Two states with equally seeded generators issue the same IDs; a different seed differs."""
    runs = [[batch(state(seed=seed).issue(NOW + i, 3)).ranges[0] for i in range(20)] for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_random_start_zero_starts_every_millisecond_at_zero() -> None:
    """With random_start=0 (disabled), every new millisecond starts its sequence at 0."""
    gen = state(random_start=0)
    assert [first_sequence(LEAF, gen.issue(NOW + i, 2)) for i in range(50)] == [0] * 50


def test_random_start_is_capped_at_the_sequence_space() -> None:
    """A 3-bit sequence with random_start=100 still issues: starts fall in [0, 8)."""
    layout = SnowflakeLayout(timestamp_bits=41, worker_bits=10, sequence_bits=3)
    gen = state(layout)
    starts = {first_sequence(layout, gen.issue(NOW + i, 1)) for i in range(200)}
    assert starts == set(range(8))


def test_same_millisecond_continues_the_sequence() -> None:
    """Takes within one millisecond continue where the previous one stopped, without gaps."""
    gen = state()
    one = batch(gen.issue(NOW, 3))
    two = batch(gen.issue(NOW, 2))
    assert two.ranges == [(one.ranges[0][1] + 1, one.ranges[0][1] + 2)]
    assert gen.last_ms == NOW


def test_a_batch_of_4096_is_one_range() -> None:
    """With sequence start 0, one take fills the whole millisecond as a single arithmetic range."""
    gen = state(random_start=0)
    full = batch(gen.issue(NOW, 4096))
    first = LEAF.compose(NOW, 7, 0)
    assert full.ranges == [(first, first + 4095)]
    assert full.complete
    assert full.count == 4096


def test_sequence_overflow_returns_a_partial_batch_then_waits_for_the_next_millisecond() -> None:
    """A request over the millisecond's space gets what is left, then WaitUntil(next ms), then the rest."""
    gen = state(random_start=0)
    part = batch(gen.issue(NOW, 5000))
    assert (part.count, part.remaining, part.complete) == (4096, 904, False)
    assert gen.issue(NOW, part.remaining) == WaitUntil(NOW + 1, "sequence_exhausted")
    rest = batch(gen.issue(NOW + 1, part.remaining))
    assert rest.complete
    assert rest.ranges == [(LEAF.compose(NOW + 1, 7, 0), LEAF.compose(NOW + 1, 7, 903))]


def test_random_start_leaves_less_room_in_the_millisecond() -> None:
    """With a random start s, a millisecond holds 4096 - s IDs (Leaf never wraps to the low sequences)."""
    gen = state(seed=3)
    part = batch(gen.issue(NOW, 4096))
    start = LEAF.decompose(part.ranges[0][0]).sequence
    assert start > 0  # seed 3 draws a non-zero start; otherwise this test shows nothing
    assert (part.count, part.remaining) == (4096 - start, start)
    assert LEAF.decompose(part.ranges[0][1]).sequence == 4095


@pytest.mark.parametrize("count", [0, -1])
def test_count_below_one_is_refused(count: int) -> None:
    """A take refuses a count of zero or less, and issues nothing."""
    gen = state()
    with pytest.raises(InvalidCount):
        gen.issue(NOW, count)
    assert gen.last_ms == 0


def test_worker_id_must_fit_the_layout() -> None:
    """A worker id outside [0, max_worker_id] is refused when the state is built."""
    with pytest.raises(WorkerIdOutOfRange, match="between 0 and 1023"):
        SnowflakeState(LEAF, 1024)
    with pytest.raises(WorkerIdOutOfRange):
        SnowflakeState(LEAF, -1)
    assert SnowflakeState(SnowflakeLayout(worker_bits=0, sequence_bits=12), 0).worker_id == 0


@pytest.mark.parametrize("knob", ["random_start", "max_backward_ms", "max_startup_wait_ms"])
def test_negative_knobs_are_refused(knob: str) -> None:
    """Negative random_start, max_backward_ms or max_startup_wait_ms is a configuration error."""
    knobs: dict[str, int] = {knob: -1}
    with pytest.raises(ValueError, match=knob):
        state(**knobs)


# --- generator: clock out of the layout -----------------------------------------------------------------


def test_clock_past_the_layout_end_is_refused() -> None:
    """The last millisecond of the layout still issues; the one after raises ClockOutOfRange."""
    gen = state(random_start=0)
    last = batch(gen.issue(LEAF.max_timestamp_ms, 1)).ranges[0][0]
    assert LEAF.decompose(last).timestamp_ms == LEAF.max_timestamp_ms
    assert last >= 0
    with pytest.raises(ClockOutOfRange, match="past the layout's last millisecond"):
        gen.issue(LEAF.max_timestamp_ms + 1, 1)
    assert gen.last_ms == LEAF.max_timestamp_ms


def test_clock_before_the_epoch_is_refused() -> None:
    """A clock reading before the epoch raises ClockOutOfRange instead of a negative timestamp."""
    with pytest.raises(ClockOutOfRange, match="before the layout's epoch"):
        state().issue(LEAF_EPOCH_MS - 1, 1)
    assert batch(state().issue(LEAF_EPOCH_MS, 1)).ranges[0][0] >= 0


# --- generator: clock rollback ----------------------------------------------------------------------------


def test_small_rollback_waits_twice_the_offset_then_issues_if_caught_up() -> None:
    """Clock 3 ms behind: WaitUntil(now + 6); at that reading the state issues again, above the old IDs."""
    gen = state()
    before = batch(gen.issue(NOW, 1)).ranges[0][1]
    assert gen.issue(NOW - 3, 1) == WaitUntil(NOW - 3 + 6, "clock_back")
    after = batch(gen.issue(NOW + 3, 1))
    assert after.ranges[0][0] > before
    assert gen.last_ms == NOW + 3


def test_small_rollback_then_clock_exactly_caught_up_continues_the_millisecond() -> None:
    """Coming back at exactly the last issued millisecond is not behind: it continues that ms's sequence."""
    gen = state()
    before = batch(gen.issue(NOW, 1)).ranges[0][1]
    assert isinstance(gen.issue(NOW - 1, 1), WaitUntil)
    assert batch(gen.issue(NOW, 1)).ranges[0][0] == before + 1


def test_small_rollback_still_behind_after_the_wait_is_an_error() -> None:
    """If the clock is still behind the last issued ms when the caller comes back, ClockMovedBackwards."""
    gen = state()
    gen.issue(NOW, 1)
    assert gen.issue(NOW - 5, 1) == WaitUntil(NOW + 5, "clock_back")
    with pytest.raises(ClockMovedBackwards) as caught:
        gen.issue(NOW - 1, 1)
    assert (caught.value.last_ms, caught.value.now_ms) == (NOW, NOW - 1)
    assert caught.value.retryable
    assert gen.last_ms == NOW


def test_after_a_rollback_error_the_next_request_gets_its_own_wait() -> None:
    """The one-wait allowance is per request: after an error, a new small rollback is waited out again."""
    gen = state()
    gen.issue(NOW, 1)
    gen.issue(NOW - 2, 1)
    with pytest.raises(ClockMovedBackwards):
        gen.issue(NOW - 2, 1)
    assert gen.issue(NOW - 2, 1) == WaitUntil(NOW + 2, "clock_back")


def test_each_rollback_after_the_clock_caught_up_gets_its_own_wait() -> None:
    """Once the clock has caught up and IDs were issued, a later small rollback is waited out again."""
    for caught_up in (NOW + 2, NOW):  # into a new millisecond, or back to the last one
        gen = state()
        gen.issue(NOW, 1)
        assert gen.issue(NOW - 2, 1) == WaitUntil(NOW + 2, "clock_back")
        assert isinstance(gen.issue(caught_up, 1), Issued)
        assert gen.issue(caught_up - 1, 1) == WaitUntil(caught_up + 1, "clock_back")


def test_large_rollback_is_an_error_at_once() -> None:
    """A rollback of more than max_backward_ms raises immediately, with no wait and no ID."""
    gen = state()
    gen.issue(NOW, 1)
    with pytest.raises(ClockMovedBackwards, match="by 6 ms"):
        gen.issue(NOW - 6, 1)
    assert gen.last_ms == NOW


def test_rollback_tolerance_is_configurable() -> None:
    """max_backward_ms=0 makes any rollback an error; a larger tolerance waits out a larger rollback."""
    strict = state(max_backward_ms=0)
    strict.issue(NOW, 1)
    with pytest.raises(ClockMovedBackwards):
        strict.issue(NOW - 1, 1)
    lenient = state(max_backward_ms=50)
    lenient.issue(NOW, 1)
    assert lenient.issue(NOW - 50, 1) == WaitUntil(NOW + 50, "clock_back")


# --- generator: high-water mark and start-up --------------------------------------------------------------


def test_no_id_at_or_below_the_high_water_mark() -> None:
    """A clock at or behind the high-water mark waits until mark + 1, and the first ID is after it."""
    mark = NOW + 1000
    gen = state(high_water_ms=mark)
    assert gen.last_ms == mark
    assert gen.issue(mark, 1) == WaitUntil(mark + 1, "high_water")
    assert gen.issue(NOW, 1) == WaitUntil(mark + 1, "high_water")
    assert gen.issue(mark - 4999, 1) == WaitUntil(mark + 1, "high_water")
    first = batch(gen.issue(mark + 1, 1)).ranges[0][0]
    assert LEAF.decompose(first).timestamp_ms == mark + 1


def test_clock_too_far_behind_the_high_water_mark_is_an_error() -> None:
    """A wait longer than max_startup_wait_ms for the high-water mark is ClockBehindRecorded, not a hang."""
    mark = NOW + 1000
    gen = state(high_water_ms=mark, max_startup_wait_ms=100)
    assert gen.issue(mark - 99, 1) == WaitUntil(mark + 1, "high_water")
    with pytest.raises(ClockBehindRecorded) as caught:
        gen.issue(mark - 100, 1)
    assert (caught.value.recorded_ms, caught.value.now_ms) == (mark, mark - 100)


def test_high_water_wait_is_not_limited_to_one_check() -> None:
    """Coming back a little early for the high-water mark (slewed clock) waits again instead of failing."""
    mark = NOW + 10
    gen = state(high_water_ms=mark)
    assert gen.issue(NOW, 1) == WaitUntil(mark + 1, "high_water")
    assert gen.issue(mark, 1) == WaitUntil(mark + 1, "high_water")
    assert isinstance(gen.issue(mark + 1, 1), Issued)


def test_restart_with_the_last_ms_as_high_water_never_reissues() -> None:
    """A new state given the old one's last_ms issues only larger IDs, even in the same clock millisecond."""
    old = state(random_start=0)
    old_last = batch(old.issue(NOW, 10)).ranges[0][1]
    new = state(random_start=0, high_water_ms=old.last_ms)
    assert new.issue(NOW, 1) == WaitUntil(NOW + 1, "high_water")
    assert batch(new.issue(NOW + 1, 1)).ranges[0][0] > old_last


def test_startup_check_waits_out_a_short_lag_and_refuses_a_long_one() -> None:
    """check_startup_clock: no wait past the mark (or without one), a wait to mark + 1 within the limit, else an error."""
    assert check_startup_clock(NOW, 0, 0) == 0
    assert check_startup_clock(NOW + 1, NOW, 0) == 0
    assert check_startup_clock(NOW, NOW, 1) == 1
    assert check_startup_clock(NOW - 99, NOW, 100) == 100
    with pytest.raises(ClockBehindRecorded, match="1 ms behind"):
        check_startup_clock(NOW - 1, NOW, 1)
    with pytest.raises(ClockBehindRecorded, match="100 ms behind"):
        check_startup_clock(NOW - 100, NOW, 100)


# --- properties: the shell's loop under any clock ----------------------------------------------------------


@dataclass
class ShellRun:
    """What a simulated shell saw: every batch, the clock reading it was issued at, and the errors."""

    batches: list[tuple[int, Issued]] = field(default_factory=list)
    errors: list[DispenserError] = field(default_factory=list)
    waits: list[tuple[int, WaitUntil]] = field(default_factory=list)


def run_shell(gen: SnowflakeState, start_ms: int, steps: list[tuple[int | None, int]]) -> ShellRun:
    """Drive ``gen`` like the async shell: one request at a time, obeying (or not) each WaitUntil."""
    run = ShellRun()
    clock = start_ms
    pending: WaitUntil | None = None
    left = 0
    for move, count in steps:
        if left == 0:
            left = count
        if move is None:
            if pending is not None:
                clock = max(clock, pending.ms)
        else:
            clock += move
        try:
            decision = gen.issue(clock, left)
        except (ClockMovedBackwards, ClockBehindRecorded, ClockOutOfRange) as error:
            run.errors.append(error)
            left, pending = 0, None  # the request fails with an error reply
            continue
        if isinstance(decision, WaitUntil):
            run.waits.append((clock, decision))
            pending = decision
        else:
            run.batches.append((clock, decision))
            left, pending = decision.remaining, None
    return run


def check_issued(layout: SnowflakeLayout, worker_id: int, high_water_ms: int, run: ShellRun) -> None:
    """Every ID is in range and stamped with its reading, and ranges strictly increase (so none repeats)."""
    previous = -1
    for clock, issued in run.batches:
        assert issued.ranges
        for first, last in issued.ranges:
            assert previous < first <= last <= layout.max_id
            previous = last
            for snowflake_id in (first, last):
                decoded = layout.decompose(snowflake_id)
                assert decoded.timestamp_ms == clock > high_water_ms
                assert decoded.worker_id == worker_id
                assert 0 <= decoded.sequence <= layout.max_sequence
            # A range never spans two milliseconds: its ends decode to the same timestamp.
            assert layout.decompose(first).timestamp_ms == layout.decompose(last).timestamp_ms
    for clock, wait in run.waits:
        assert wait.ms > clock  # the shell never spins


@given(
    layout=snowflake_layouts(),
    data=st.data(),
    steps=st.lists(st.tuples(clock_moves, request_counts), max_size=60),
    random_start=st.sampled_from([0, 1, 100]),
    max_backward_ms=st.integers(0, 10),
)
def test_no_id_twice_under_any_clock(
    layout: SnowflakeLayout,
    data: st.DataObject,
    steps: list[tuple[int | None, int]],
    random_start: int,
    max_backward_ms: int,
) -> None:
    """Under any clock readings and counts, IDs are unique, non-negative, in range and strictly increasing."""
    worker_id = data.draw(st.integers(0, layout.max_worker_id), label="worker_id")
    start = data.draw(st.integers(layout.epoch_ms, layout.max_timestamp_ms), label="start")
    high_water = data.draw(st.just(0) | st.integers(start - 10_000, start + 10_000), label="high_water")
    gen = SnowflakeState(
        layout,
        worker_id,
        high_water_ms=high_water,
        random_start=random_start,
        max_backward_ms=max_backward_ms,
        rng=random.Random(data.draw(st.integers(0, 2**32), label="seed")),
    )
    run = run_shell(gen, start, steps)
    check_issued(layout, worker_id, high_water, run)
    issued_ms = [clock for clock, _ in run.batches]
    assert gen.last_ms == max([high_water, *issued_ms])


@given(
    steps=st.lists(st.tuples(st.none() | st.integers(0, 3), request_counts), max_size=60),
    seed=st.integers(0, 2**32),
)
def test_forward_clock_and_obedient_shell_never_fail(steps: list[tuple[int | None, int]], seed: int) -> None:
    """With a clock that never goes back and a shell that sleeps as told, no request ever errors."""
    gen = SnowflakeState(LEAF, 3, rng=random.Random(seed))
    run = run_shell(gen, NOW, steps)
    assert run.errors == []
    check_issued(LEAF, 3, 0, run)
    assert all(wait.reason == "sequence_exhausted" for _, wait in run.waits)


@given(steps=st.lists(st.tuples(st.integers(-5, 5) | st.none(), st.integers(1, 9)), max_size=60))
def test_every_issued_id_is_counted(steps: list[tuple[int | None, int]]) -> None:
    """The IDs in each batch number exactly the count asked for minus what the batch says remains."""
    gen = SnowflakeState(SnowflakeLayout(sequence_bits=3), 1, rng=random.Random(0))
    clock, left = NOW, 0
    for move, count in steps:
        left = left or count
        clock += move or 0
        try:
            decision = gen.issue(clock, left)
        except ClockMovedBackwards:
            left = 0
            continue
        if isinstance(decision, Issued):
            assert decision.count == left - decision.remaining > 0
            left = decision.remaining


MACHINE_STARTUP_WAIT_MS = 5
"""Small, so that the machine's clock moves reach both a start-up wait and a refusal."""


class SnowflakeMachine(RuleBasedStateMachine):
    """One worker over time: takes, clock jumps, obeyed waits, restarts from the persisted high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        # A 3-bit sequence runs out often, so overflow and rollback interleave.
        self.layout = SnowflakeLayout(timestamp_bits=41, worker_bits=2, sequence_bits=3)
        self.clock = NOW
        self.seed = 0
        self.gen = self.new_state(high_water_ms=0)
        self.last_id = -1
        self.last_issued_ms = 0
        self.wait: WaitUntil | None = None

    def new_state(self, high_water_ms: int) -> SnowflakeState:
        self.seed += 1
        return SnowflakeState(
            self.layout,
            2,
            high_water_ms=high_water_ms,
            max_startup_wait_ms=MACHINE_STARTUP_WAIT_MS,
            rng=random.Random(self.seed),
        )

    @rule(ms=st.integers(0, 3))
    def clock_forward(self, ms: int) -> None:
        self.clock += ms

    @rule(ms=st.integers(1, 12))
    def clock_back(self, ms: int) -> None:
        self.clock -= ms

    @precondition(lambda self: self.wait is not None)
    @rule()
    def sleep_as_told(self) -> None:
        assert self.wait is not None
        self.clock = max(self.clock, self.wait.ms)

    @rule(count=st.integers(1, 20))
    def take(self, count: int) -> None:
        last_ms_before = self.gen.last_ms
        try:
            decision = self.gen.issue(self.clock, count)
        except (ClockMovedBackwards, ClockBehindRecorded):
            assert self.clock <= last_ms_before
            assert self.gen.last_ms == last_ms_before
            self.wait = None
            return
        if isinstance(decision, WaitUntil):
            assert decision.ms > self.clock
            assert self.gen.last_ms == last_ms_before
            self.wait = decision
            return
        self.wait = None
        ((first, last),) = decision.ranges
        assert first > self.last_id
        assert self.layout.decompose(last).timestamp_ms == self.clock
        self.last_id = last
        self.last_issued_ms = self.clock

    @rule()
    def restart(self) -> None:
        """The process stops; the next one starts from the persisted last_ms, if the clock allows."""
        recorded = self.gen.last_ms
        try:
            wait_ms = check_startup_clock(self.clock, recorded, MACHINE_STARTUP_WAIT_MS)
        except ClockBehindRecorded:
            assert recorded - self.clock >= MACHINE_STARTUP_WAIT_MS
            return  # the shell refuses to start; the old process keeps running in this model
        assert wait_ms == max(0, recorded + 1 - self.clock)
        self.gen = self.new_state(high_water_ms=recorded)  # it waits out the mark itself, as the shell does
        self.wait = None

    @invariant()
    def last_ms_covers_every_issued_id(self) -> None:
        assert self.gen.last_ms >= self.last_issued_ms


TestSnowflakeMachine = SnowflakeMachine.TestCase


def test_room_tells_how_many_ids_fit_without_waiting() -> None:
    """room() is the worst-case room of a new millisecond, the rest of the current one, 0 when behind."""
    layout = SnowflakeLayout(timestamp_bits=41, worker_bits=10, sequence_bits=4)
    state = SnowflakeState(layout, 1, random_start=5, rng=random.Random(7))
    now = layout.epoch_ms + 1000
    assert state.room(now) == 16 - 4
    batch = state.issue(now, 3)
    assert isinstance(batch, Issued)
    first_sequence = layout.decompose(batch.ranges[0][0]).sequence
    assert state.room(now) == 16 - (first_sequence + 3)
    assert state.room(now - 1) == 0
    rest = state.issue(now, state.room(now))
    assert rest == Issued([(batch.ranges[0][1] + 1, layout.compose(now, 1, 15))], 0)
