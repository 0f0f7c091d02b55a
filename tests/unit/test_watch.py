"""``dispenser watch``'s table from rate events alone (the end-to-end `watch --once` is in test_rates)."""

from __future__ import annotations

import msgspec

from dispenser.messages import RateEvent
from dispenser.watch import Fleet


def event(worker: str, time: float, **fields: object) -> RateEvent:
    base = {"tag": "order", "kind": "segment", "worker": worker, "time": time, "window_s": 10}
    rates = {"ids_per_s": 100.0, "requests_per_s": 10.0, "peak_ids_per_s": 120.0}
    return msgspec.convert(base | rates | fields, RateEvent)


def row(fleet: Fleet, now: float) -> dict[str, str]:
    headers = ["TAG", "KIND", "WORKERS", "IDS/S", "PEAK/S", "STEP", "BUFFERED", "RUNWAY", "FETCH/MIN"]
    [only] = list(fleet.rows(now))
    return dict(zip(headers, only, strict=True))


def test_one_event_per_worker_is_enough_for_fetches_per_minute() -> None:
    """`watch --once` sees each worker once: the figure comes from the event, summed over the fleet."""
    fleet = Fleet()
    fleet.add(event("a", 1000.0, fetches=40, fetches_per_min=2.5, step=9000), received=1.0)
    fleet.add(event("b", 1000.2, fetches=7, fetches_per_min=1.5, step=9000), received=1.2)
    shown = row(fleet, now=2.0)
    assert shown["WORKERS"] == "2"
    assert shown["FETCH/MIN"] == "4.0"
    assert shown["IDS/S"] == "200"


def test_workers_without_the_field_are_measured_between_their_events() -> None:
    """An older worker's events carry only the running count: the change between two is the figure."""
    fleet = Fleet()
    fleet.add(event("old", 1000.0, fetches=10), received=1.0)
    assert row(fleet, now=1.0)["FETCH/MIN"] == "0.0"  # one event: nothing to measure yet
    fleet.add(event("old", 1030.0, fetches=13), received=31.0)
    assert row(fleet, now=31.0)["FETCH/MIN"] == "6.0"


def test_silent_workers_drop_out() -> None:
    """A worker silent for longer than ``stale_after`` no longer counts."""
    fleet = Fleet(stale_after=5.0)
    fleet.add(event("a", 1000.0, fetches_per_min=3.0), received=1.0)
    fleet.add(event("b", 1009.0, fetches_per_min=1.0), received=10.0)
    shown = row(fleet, now=10.0)
    assert (shown["WORKERS"], shown["FETCH/MIN"]) == ("1", "1.0")
