"""The snowflake shell against an in-memory registry: what it does while its worker ID changes hands."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.core.errors import LeaseLost, Unavailable, WorkerIdInUse
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import Reply
from dispenser.ports import WorkerLease
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.testing.clock import ManualClock, settle

LAYOUT = SnowflakeLayout()


class SwitchingRegistry:
    """Loses its lease on demand; registering again claims worker ID 1, and vouches for it at once."""

    def __init__(self) -> None:
        self.held = True
        self.claimed = asyncio.Event()
        self.release = asyncio.Event()

    async def register(self) -> WorkerLease:
        self.held = True  # the claim is in: from here on can_issue() is true, for ID 1
        self.claimed.set()
        await self.release.wait()  # e.g. reading the ID's high-water node
        return WorkerLease(1, 0)

    async def report(self, high_water_ms: int) -> None:
        return None

    def can_issue(self) -> bool:
        return self.held

    async def close(self) -> None:
        return None


async def no_persist(_worker_id: int, _high_water_ms: int) -> None:
    return None


async def test_nothing_is_issued_under_the_old_id_while_a_new_one_is_being_registered() -> None:
    """After a lost lease, no ID comes out until the new worker ID replaced the old one in the generator."""
    registry = SwitchingRegistry()
    clock = ManualClock()
    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(0, 0),
        registry,
        clock,
        no_persist,
        settings=SnowflakeSettings(report_interval=3600.0),
    )
    await generator.start()
    first = generator.try_take("t", 1)
    assert first is not None
    assert LAYOUT.decompose(first.ranges[0][0]).worker_id == 0
    registry.held = False
    with pytest.raises(LeaseLost):
        generator.try_take("t", 1)
    await registry.claimed.wait()
    assert registry.can_issue()  # the registry vouches for ID 1, but the generator still holds ID 0
    with pytest.raises(LeaseLost):
        generator.try_take("t", 1)
    with pytest.raises(LeaseLost):
        await generator.take("t", 1, clock.monotonic() + 1)
    registry.release.set()
    await clock.run_until(lambda: generator.worker_id == 1)
    batch = generator.try_take("t", 1)
    assert batch is not None
    assert LAYOUT.decompose(batch.ranges[0][0]).worker_id == 1
    await generator.stop()


async def fixed_registry() -> StaticRegistry:
    """Worker ID 5, registered (these tests are about the generator, not a registry)."""
    registry = StaticRegistry(5, max_worker_id=LAYOUT.max_worker_id)
    await registry.register()
    return registry


async def test_a_start_below_the_recorded_mark_waits_it_out_on_the_clock() -> None:
    """Recorded mark 3 s ahead (a crash's reservation): start() returns only once the clock has passed it."""
    clock = ManualClock()
    mark = clock.wall_ms() + 3_000
    generator = SnowflakeGenerator(LAYOUT, WorkerLease(5, mark), await fixed_registry(), clock, no_persist)
    starting = asyncio.ensure_future(generator.start())
    await clock.advance(2.9)
    assert not starting.done()
    await clock.advance(0.2)
    await starting
    batch = generator.try_take("t", 1)
    assert batch is not None
    assert LAYOUT.decompose(batch.ranges[0][0]).timestamp_ms > mark
    await generator.stop()


async def test_an_exhausted_millisecond_waits_for_the_next_one() -> None:
    """More IDs than one millisecond holds: the rest come from the next one, once the clock gets there."""
    clock = ManualClock()
    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(5, 0),
        await fixed_registry(),
        clock,
        no_persist,
        settings=SnowflakeSettings(random_start=0),
    )
    await generator.start()
    per_ms = 1 << LAYOUT.sequence_bits
    taking = asyncio.ensure_future(generator.take("t", per_ms + 10, clock.monotonic() + 1))
    await settle()
    assert not taking.done()
    await clock.advance(0.001)
    await settle()
    batch = await taking
    stamps = {LAYOUT.decompose(first).timestamp_ms for first, _ in batch.ranges}
    assert len(stamps) == 2
    assert sum(last - first + 1 for first, last in batch.ranges) == per_ms + 10
    await generator.stop()


async def test_a_clean_stop_records_the_last_millisecond_and_the_reservation() -> None:
    """stop() hands the exact last millisecond and the reserved mark to persist_clean_stop."""
    clock = ManualClock()
    recorded: list[tuple[int, int, int]] = []

    async def clean(worker_id: int, last_ms: int, reserved_ms: int) -> None:
        recorded.append((worker_id, last_ms, reserved_ms))

    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(5, 0),
        await fixed_registry(),
        clock,
        no_persist,
        settings=SnowflakeSettings(report_interval=3.0),
        persist_clean_stop=clean,
    )
    await generator.start()
    batch = generator.try_take("t", 1)
    assert batch is not None
    issued_ms = LAYOUT.decompose(batch.ranges[0][0]).timestamp_ms
    await generator.stop()
    assert recorded == [(5, issued_ms, clock.wall_ms() + 6_000)]


def test_the_reservation_covers_a_registry_outage_the_lease_survives() -> None:
    """Two report intervals ahead, and at least a report interval plus the registry outage to sit out."""
    assert SnowflakeSettings(report_interval=3.0).reserve_ahead_ms == 6_000  # Leaf's interval: as before
    assert SnowflakeSettings(report_interval=0.2).reserve_ahead_ms == 400
    assert SnowflakeSettings(report_interval=0.2, registry_outage=4.0).reserve_ahead_ms == 4_200
    assert SnowflakeSettings(report_interval=3.0, registry_outage=1.0).reserve_ahead_ms == 6_000


@pytest.mark.parametrize(("outage", "served"), [(0.0, False), (1.0, True)])
async def test_a_registry_that_hangs_for_an_election_holds_up_no_request(outage: float, served: bool) -> None:
    """A renewal stuck for 0.9 s (a ZooKeeper leader election): IDs keep coming if the reservation covers it.

    Issue 22: the lease mode reserved 0.4 s ahead (the tests' 0.2 s report interval), and requests waited
    for ZooKeeper.
    """
    clock = ManualClock()
    registry_back = asyncio.Event()
    registry_back.set()

    async def persist(_worker_id: int, _high_water_ms: int) -> None:
        await registry_back.wait()

    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(5, 0),
        await fixed_registry(),
        clock,
        persist,
        settings=SnowflakeSettings(report_interval=0.2, registry_outage=outage),
    )
    await generator.start()
    registry_back.clear()  # every renewal from now on hangs
    issued = []
    for _ in range(9):
        await clock.advance(0.1)
        issued.append(generator.try_take("t", 1) is not None)
    assert all(issued) is served
    registry_back.set()
    await settle()
    await generator.stop()


async def test_a_refusing_generator_issues_nothing() -> None:
    """refuse(): every take raises the error (a live peer holds the ID), for good."""
    clock = ManualClock()
    generator = SnowflakeGenerator(LAYOUT, WorkerLease(5, 0), await fixed_registry(), clock, no_persist)
    await generator.start()
    assert generator.try_take("t", 1) is not None
    generator.refuse(WorkerIdInUse(0, 5, "10.0.0.2:7 (serving)"))
    assert not generator.holds_lease
    with pytest.raises(WorkerIdInUse, match="worker ID 5 of datacenter 0"):
        generator.try_take("t", 1)
    with pytest.raises(WorkerIdInUse):
        await generator.take("t", 1, clock.monotonic() + 1)
    await generator.stop()


class ScriptedWrites:
    """A ``persist`` (the high-water write) a test scripts: when each write came, and how it fails.

    A write waits while :attr:`held` is set (a hung server), then raises the first of :attr:`once`
    (removed), else :attr:`always` if set, else succeeds.
    """

    def __init__(self, clock: ManualClock) -> None:
        self._clock = clock
        self.at: list[float] = []
        self.once: list[Exception] = []
        self.always: Exception | None = None
        self.held: asyncio.Event | None = None

    async def __call__(self, _worker_id: int, _high_water_ms: int) -> None:
        self.at.append(self._clock.monotonic())
        if self.held is not None:
            await self.held.wait()
        if self.once:
            raise self.once.pop(0)
        if self.always is not None:
            raise self.always


async def renewing_each_second(clock: ManualClock, writes: ScriptedWrites) -> SnowflakeGenerator:
    """A started generator for worker ID 5 whose mark is renewed each second (reserved 2 s ahead)."""
    generator = SnowflakeGenerator(
        LAYOUT, WorkerLease(5, 0), await fixed_registry(), clock, writes,
        settings=SnowflakeSettings(report_interval=1.0),
    )  # fmt: skip
    await generator.start()
    return generator


async def test_a_reservation_that_fails_is_tried_again_within_the_request_deadline() -> None:
    """The high-water write fails once (a dropped ZooKeeper connection): the request still gets its IDs.

    Seen in the ZooKeeper hang test: `unavailable` in the first second of a hung server, the lease still good.
    """
    clock = ManualClock()
    writes = ScriptedWrites(clock)
    generator = await renewing_each_second(clock, writes)
    writes.always = OSError("ConnectionLoss")  # every renewal fails: the mark stays where the start put it
    await clock.advance(2.1)
    assert generator.try_take("t", 1) is None  # needs a reservation first
    writes.always, writes.once = None, [OSError("ConnectionLoss")]  # the request's own write fails once
    writes.at.clear()
    taking = asyncio.create_task(generator.take("t", 1, clock.monotonic() + 1))
    assert await clock.run_until(taking.done) == pytest.approx(0.05)  # a pause of _LEASE_POLL between tries
    assert taking.result().count == 1
    assert (writes.once, len(writes.at)) == ([], 2)  # the failed reservation, the one that held
    await generator.stop()


async def test_a_request_waits_for_a_hung_reservation_until_its_deadline_on_the_generators_clock() -> None:
    """The high-water write hangs (a frozen ZooKeeper): `unavailable` at the request's deadline, in clock time.

    Its wait was on the event loop's clock, which a manual clock does not move.
    """
    clock = ManualClock()
    writes = ScriptedWrites(clock)
    generator = await renewing_each_second(clock, writes)
    writes.held = hung = asyncio.Event()  # every write from now on hangs: the mark stays 2 s ahead of 0
    await clock.advance(2.1)
    taking = asyncio.create_task(generator.take("t", 1, clock.monotonic() + 1))
    assert await clock.run_until(taking.done) == pytest.approx(1.0, abs=0.011)  # to run_until's step
    with pytest.raises(Unavailable, match="took longer than the request may wait"):
        taking.result()
    hung.set()
    await generator.stop()


async def test_a_reservation_refused_for_good_is_not_tried_again() -> None:
    """The high-water write says the lease is gone: the request gets that at once, after one write."""
    clock = ManualClock()
    writes = ScriptedWrites(clock)
    generator = await renewing_each_second(clock, writes)
    writes.always = OSError("ConnectionLoss")  # the renewals fail: the mark stays 2 s ahead of 0
    await clock.advance(2.5)
    writes.always = LeaseLost(5, "its lease node belongs to another session")
    writes.at.clear()
    with pytest.raises(LeaseLost, match="another session"):
        await generator.take("t", 1, clock.monotonic() + 1)
    assert len(writes.at) == 1
    await generator.stop()


async def test_a_failed_renewal_is_tried_again_soon() -> None:
    """A renewal that fails is tried again 0.1 s later (doubling), not a report interval later.

    A whole interval let the mark run out behind a hung ZooKeeper server, and requests waited for it.
    """
    clock = ManualClock()
    writes = ScriptedWrites(clock)
    generator = await renewing_each_second(clock, writes)
    started = clock.monotonic()
    writes.once = [OSError("ConnectionLoss"), OSError("ConnectionLoss")]
    await clock.advance(2.5)
    tries = [round(t - started, 2) for t in writes.at[1:]]
    assert tries == [1.0, 1.1, 1.3, 2.3], tries  # failed, failed, renewed; then the interval again
    await generator.stop()


async def test_a_state_file_that_cannot_be_written_is_not_named_in_the_reply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The local state file refuses the mark: the reply says what failed, not where the file is (issue 33 item 8).

    The OSError's text (the state directory's path) went into the ``unavailable`` reply; it stays in
    ``str(error)`` and the renewal's log line.
    """
    caplog.set_level(logging.WARNING)
    path = "/var/lib/hidden-state-dir/snowflake-order-10.0.0.7_8080.json"
    clock = ManualClock()
    writes = ScriptedWrites(clock)
    generator = await renewing_each_second(clock, writes)
    d = Dispatcher(generator, clock, Limits(deadline=0.5), kind="snowflake")
    writes.always = PermissionError(13, "Permission denied", path)  # every write of the mark fails
    await clock.advance(2.1)  # past the mark the start reserved (2 s ahead)
    answering = asyncio.create_task(d.answer("t", d.decode("t", b'{"count": 1}')))
    await clock.run_until(answering.done)
    answer = answering.result()
    error = msgspec.json.decode(answer.body, type=Reply).error
    assert error is not None
    assert (error.code, error.retryable) == ("unavailable", True)
    assert "PermissionError" in error.message
    assert "hidden-state-dir" not in answer.body.decode()
    assert answer.error is not None
    assert path in str(answer.error)  # the operator's text (logs, the CLI) still says where
    assert path in caplog.text  # the failed renewal's warning
    await generator.stop()


async def test_a_refusal_is_answered_without_the_live_peers_address() -> None:
    """The peer guard's refusal (``worker_id_in_use``) does not tell callers where the other worker runs.

    Its address (ip:port) went into every snowflake reply; it stays in ``str(error)``, which is logged.
    """
    clock = ManualClock()
    generator = SnowflakeGenerator(LAYOUT, WorkerLease(5, 0), await fixed_registry(), clock, no_persist)
    await generator.start()
    d = Dispatcher(generator, clock, Limits(), kind="snowflake")
    generator.refuse(WorkerIdInUse(0, 5, "10.0.0.2:7 (serving)"))
    answer = await d.answer("t", d.decode("t", b'{"count": 1}'))
    error = msgspec.json.decode(answer.body, type=Reply).error
    assert error is not None
    assert error.code == "worker_id_in_use"
    assert "is also claimed by another live worker" in error.message
    assert "10.0.0.2" not in answer.body.decode()
    assert "the live worker 10.0.0.2:7 (serving)" in str(answer.error)
    await generator.stop()
