"""The rate book's fleet peak: saved per fleet, so a fleet restarted at any size sizes from the whole demand.

Two workers on one virtual clock, their events handed to each other as the broker would, the peaks
saved through the in-memory store (the real one is in tests/integration/test_rates.py).
"""

from __future__ import annotations

from dispenser.core.step import StepPolicy
from dispenser.service.rates import RateBook, RateSettings
from dispenser.testing.clock import ManualClock
from dispenser.testing.fakes import MemorySegmentStore

S = 10.0
SETTINGS = RateSettings(window=2, stale_after=3.0)


def book(clock: ManualClock, name: str) -> RateBook:
    return RateBook(clock, SETTINGS, StepPolicy(segment_seconds=S), worker=name)


async def run(clock: ManualClock, books: list[RateBook], per_second: int, seconds: int) -> None:
    """Each book hands out ``per_second`` IDs a second of tag ``order``; they hear each other every second."""
    for _ in range(seconds):
        for b in books:
            for tenth in range(10):
                b.meter("segment", "order").record(clock.monotonic() + tenth / 10, per_second // 10)
        await clock.advance(1.0)
        for b in books:
            for other in books:
                if other is not b:
                    b.observe(other.event("segment", "order"))


def first_step(b: RateBook) -> int:
    """The step of a first fetch (no step before, no traffic yet, configured step 1)."""
    return b.policy.next_step(1, None, b.view("segment", "order"))


async def test_two_workers_saved_then_one_restarted_sizes_from_the_fleets_peak() -> None:
    """2 workers at 1,500 IDs/s each; both stop; one starts: its first segment is S x 3,000, not S x 1,500."""
    clock = ManualClock()
    store = MemorySegmentStore()
    a, b = book(clock, "a"), book(clock, "b")
    await run(clock, [a, b], 1500, 5)
    for worker in (a, b):  # each saves on its way out; the last writer wins
        await store.save_peaks("segment", worker.peaks("segment"))
    [(saved, _)] = (await store.load_peaks("segment")).values()
    assert saved == 3000.0
    restarted = book(clock, "c")
    restarted.restore("segment", await store.load_peaks("segment"))
    assert S * 3000 <= first_step(restarted) <= 1.25 * S * 3000
    # Its own events still say only what it measured: a peer adding them up counts no one twice.
    assert restarted.event("segment", "order").peak_ids_per_s == 0.0


async def test_the_survivor_of_two_sizes_for_the_load_it_was_left() -> None:
    """One of two workers goes silent: the other sizes for the whole fleet's peak before its own rises."""
    clock = ManualClock()
    a, b = book(clock, "a"), book(clock, "b")
    await run(clock, [a, b], 1500, 5)
    assert a.view("segment", "order").workers == 2
    await run(clock, [a], 0, 4)  # b died (silent past stale_after) before the load moved over to a
    view = a.view("segment", "order")
    assert (view.workers, view.own_peak, view.fleet_peak) == (1, 1500.0, 1500.0)
    assert view.remembered_peak == 3000.0
    assert S * 3000 <= first_step(a) <= 1.25 * S * 3000
    assert a.peaks("segment")["order"][0] == 3000.0  # and that is what it saves
    await clock.advance(SETTINGS.retention + 1)
    assert a.view("segment", "order").remembered_peak == 0.0  # forgotten, like a worker's own peak
    assert a.peaks("segment") == {}


async def test_restarted_together_the_fleet_splits_the_saved_peak() -> None:
    """Two restarted workers that hear each other size to their shares of the saved peak, not each to all."""
    clock = ManualClock()
    store = MemorySegmentStore()
    a, b = book(clock, "a"), book(clock, "b")
    await run(clock, [a, b], 1500, 5)
    await store.save_peaks("segment", a.peaks("segment"))
    c, d = book(clock, "c"), book(clock, "d")
    for worker in (c, d):
        worker.restore("segment", await store.load_peaks("segment"))
    await run(clock, [c, d], 1500, 3)
    steps = [w.policy.next_step(1, None, w.view("segment", "order")) for w in (c, d)]
    assert S * 3000 <= sum(steps) <= 1.25 * S * 3000 + 2, steps
