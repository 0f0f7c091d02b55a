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


def test_datacenters_get_a_row_each_and_the_fleet_one() -> None:
    """Workers naming their datacenter: a row per datacenter (``-``: unnamed) and ``all`` with the sums."""
    fleet = Fleet()
    fleet.add(event("a1", 1000.0, datacenter="dc-a", ids_buffered=10, runway_s=30.0), received=1.0)
    fleet.add(event("a2", 1000.0, datacenter="dc-a", ids_buffered=20, runway_s=20.0), received=1.0)
    fleet.add(event("b1", 1000.0, datacenter="dc-b", ids_buffered=5, runway_s=50.0), received=1.0)
    fleet.add(event("old", 1000.0, ids_buffered=1), received=1.0)  # a worker older than the field
    headers = fleet.headers(2.0)
    assert headers[:4] == ["TAG", "KIND", "DC", "WORKERS"]
    rows = {r[2]: dict(zip(headers, r, strict=True)) for r in fleet.rows(2.0)}
    assert list(rows) == ["-", "dc-a", "dc-b", "all"]
    assert (rows["dc-a"]["WORKERS"], rows["dc-a"]["IDS/S"], rows["dc-a"]["BUFFERED"]) == ("2", "200", "30")
    assert rows["dc-a"]["RUNWAY"] == "20s"
    assert (rows["dc-b"]["WORKERS"], rows["dc-b"]["BUFFERED"]) == ("1", "5")
    assert (rows["all"]["WORKERS"], rows["all"]["IDS/S"], rows["all"]["BUFFERED"]) == ("4", "400", "36")
    assert "DC" in fleet.table(2.0).splitlines()[0]


def test_no_datacenter_named_keeps_the_plain_table() -> None:
    """No worker names a datacenter: no DC column, one row per tag (the table as before)."""
    fleet = Fleet()
    fleet.add(event("a", 1000.0), received=1.0)
    assert "DC" not in fleet.headers(2.0)
    assert len(list(fleet.rows(2.0))) == 1


def test_a_rate_event_without_the_datacenter_decodes_and_one_with_it_is_read_by_old_readers() -> None:
    """The wire stays compatible both ways.

    An old worker's event (no field) decodes as ""; a reader that does not know the field ignores it.
    """
    old = msgspec.json.encode(event("old", 1.0))
    assert b"datacenter" in old  # encoded (as ""), harmless to old readers
    stripped = msgspec.json.decode(old)
    del stripped["datacenter"]
    assert msgspec.convert(stripped, RateEvent).datacenter == ""

    class OldRateEvent(msgspec.Struct, kw_only=True):
        tag: str
        worker: str

    new = msgspec.json.encode(event("new", 1.0, datacenter="dc-b"))
    assert msgspec.json.decode(new, type=OldRateEvent).worker == "new"
