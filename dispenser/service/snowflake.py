"""The snowflake shell: drives one :class:`SnowflakeState` with the real clock, a registry and a state file.

It adds the safety rules, each for a known way Leaf can repeat an ID: the high-water reservation (Leaf
#216), the start-up clock check, leases, and waiting out a short run-time rollback (it sleeps, never
spins). The rules in full: ``docs/snowflake.md`` ("Clock rules: never an ID twice").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dispenser.core.errors import ClockMovedBackwards, DispenserError, LeaseLost, Unavailable
from dispenser.core.ids import IdBatch
from dispenser.core.snowflake import Issued, SnowflakeLayout, SnowflakeState, WaitUntil, check_startup_clock
from dispenser.ports import Clock, WorkerLease, WorkerRegistry
from dispenser.service.retry import Backoff
from dispenser.service.timing import wait_done

__all__ = ["SnowflakeGenerator", "SnowflakeSettings"]

log = logging.getLogger(__name__)

_LEASE_POLL = 0.05
"""Seconds between lease checks while a request waits for the high-water mark to be recorded."""
_RENEW_RETRY = 0.1
"""Seconds before the first retry of a failed renewal of the high-water mark (a :class:`Backoff`)."""


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a background reservation's error as seen (its waiters, if any, got it too)."""
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class SnowflakeSettings:
    """Tuning of the snowflake shell."""

    random_start: int = 100
    max_backward_ms: int = 5
    report_interval: float = 3.0
    """Seconds between renewals of the reserved high-water mark (Leaf reports every 3 s)."""
    registry_outage: float = 0.0
    """Seconds of registry outage a renewal must be able to sit out without holding up a request. In
    ``zookeeper-lease`` mode, where the mark must be in ZooKeeper before IDs under it go out, this is the
    lease's issue window (the worker stops issuing after it anyway): a ZooKeeper leader election then
    never stalls the hot path."""

    @property
    def reserve_ahead_ms(self) -> int:
        """How far ahead of the clock the mark is reserved.

        Two report intervals, so that renewals never block, and at least a report interval plus
        ``registry_outage``.
        """
        return int(max(self.report_interval * 2, self.report_interval + self.registry_outage) * 1000)

    @property
    def max_startup_wait_ms(self) -> int:
        """A restart after a crash may find the clock up to ``reserve_ahead_ms`` behind the mark: wait that out."""
        return self.reserve_ahead_ms + 1000


Persist = Callable[[int, int], Awaitable[None]]
"""``persist(worker_id, high_water_ms)``: record the mark durably (local state file, registry)."""

PersistCleanStop = Callable[[int, int, int], Awaitable[None]]
"""``persist_clean_stop(worker_id, last_ms, reserved_ms)``: record a clean stop (see
:meth:`dispenser.registries.SnowflakeRegistration.persist_clean_stop`)."""


class SnowflakeGenerator:
    """An ID source for ``<prefix>.snowflake.<tag>``: any tag, one worker ID, never a repeat."""

    def __init__(
        self,
        layout: SnowflakeLayout,
        lease: WorkerLease,
        registry: WorkerRegistry,
        clock: Clock,
        persist: Persist,
        *,
        settings: SnowflakeSettings | None = None,
        persist_clean_stop: PersistCleanStop | None = None,
        datacenter_id: int = 0,
    ) -> None:
        self.layout = layout
        self.datacenter_id = datacenter_id
        """The datacenter folded into every ID (the layout's datacenter field)."""
        self._persist_clean_stop = persist_clean_stop
        self.settings = settings or SnowflakeSettings()
        self._registry = registry
        self._clock = clock
        self._persist = persist
        self.clock_waits = 0
        """Sleeps for the next millisecond or a small clock rollback."""
        self.rollbacks_refused = 0
        """Takes refused because the clock went back further than may be waited out."""
        self.clock_back_waits = 0
        """Small clock rollbacks (at most ``max_backward_ms``) seen and waited out: the clock did move back."""
        self.on_issue: Callable[[str, int], None] | None = None
        """Told ``(tag, count)`` after each batch issued (the rate meters)."""
        self._lock = asyncio.Lock()
        self._reserve_lock = asyncio.Lock()
        self._wait_until_ms: int | None = None
        self._reserved_ms = 0
        self._state = self._new_state(lease)
        self._tasks: list[asyncio.Task[None]] = []
        self._relocating: asyncio.Task[None] | None = None
        self._paused = False  # True from a lost lease until the new registration is in place
        self._refused: DispenserError | None = None  # set for good: see refuse()
        self._reserving: asyncio.Task[None] | None = None

    def _new_state(self, lease: WorkerLease) -> SnowflakeState:
        s = self.settings
        self._reserved_ms = lease.high_water_ms
        return SnowflakeState(
            self.layout,
            lease.worker_id,
            high_water_ms=lease.high_water_ms,
            random_start=s.random_start,
            max_backward_ms=s.max_backward_ms,
            max_startup_wait_ms=s.max_startup_wait_ms,
            datacenter_id=self.datacenter_id,
        )

    @property
    def worker_id(self) -> int:
        """The worker ID IDs are issued under now."""
        return self._state.worker_id

    @property
    def reserved_ms(self) -> int:
        """The wall-clock millisecond up to which IDs go out without recording a new high-water mark."""
        return self._reserved_ms

    @property
    def holds_lease(self) -> bool:
        """Whether IDs may be issued now: the registry vouches for the worker ID and none is being replaced.

        False from a lost lease (``zookeeper-lease`` mode: the ephemeral claim may have gone) until the new
        registration is in place; requests meanwhile get ``lease_lost``.
        """
        return not self._paused and self._refused is None and self._registry.can_issue()

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until the clock has passed the recorded mark, reserve ahead, and start renewing.

        Raises:
            ClockBehindRecorded: the clock is behind the recorded mark by more than a crash explains.
        """
        wait_ms = check_startup_clock(
            self._clock.wall_ms(), self._state.last_ms, self.settings.max_startup_wait_ms
        )
        if wait_ms:
            log.info("clock is %d ms behind the recorded high-water mark; waiting it out", wait_ms)
            await self._clock.sleep(wait_ms / 1000)
        await self._reserve(self._clock.wall_ms())
        self._tasks.append(asyncio.create_task(self._renew_loop(), name="snowflake-renew"))

    async def stop(self) -> None:
        """Stop renewing and record the exact last millisecond, so a clean restart need not wait."""
        tasks = [task for task in (*self._tasks, self._relocating) if task is not None]
        for task in tasks:
            task.cancel()
        # Await the re-registration too: the caller closes the registry next, and it must not still be in use.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._reserving is not None:
            await asyncio.gather(self._reserving, return_exceptions=True)
        async with self._lock:
            try:
                if self._persist_clean_stop is not None and not self._paused:
                    await self._persist_clean_stop(
                        self._state.worker_id, self._state.last_ms, self._reserved_ms
                    )
                else:
                    await self._persist(self._state.worker_id, self._state.last_ms)
            except (OSError, DispenserError) as exc:
                log.warning("could not record the final high-water mark (the reservation stands): %s", exc)

    # -- IdSource ----------------------------------------------------------------------------------

    def try_take(self, tag: str, count: int) -> IdBatch | None:
        """IDs at once when nothing needs waiting for; ``None`` sends the request to :meth:`take`.

        Raises:
            LeaseLost: the registry can no longer prove this worker holds its ID.
            WorkerIdInUse: a live peer holds this worker's ID (see :meth:`refuse`).
        """
        if self._lock.locked() or self._wait_until_ms is not None:
            return None
        self._check_lease()
        now = self._clock.wall_ms()
        if now > self._reserved_ms or (count > 1 and self._state.room(now) < count):
            return None  # the slow path collects the batch over several milliseconds, dropping nothing
        decision = self._core_take(now, count)
        if type(decision) is Issued:
            if decision.remaining == 0:
                if self.on_issue is not None:
                    self.on_issue(tag, count)
                return IdBatch(tuple(decision.ranges))
            # The millisecond ran out part-way: those IDs are dropped (a gap, never a repeat) and the
            # request goes to the slow path, which waits for the next millisecond.
            return None
        assert isinstance(decision, WaitUntil)
        self._wait_until_ms = decision.ms  # a clock-back wait granted now must be honoured by take()
        return None

    async def take(self, tag: str, count: int, deadline: float) -> IdBatch:
        """IDs, sleeping for the next millisecond or a small clock rollback as the core decides.

        Raises:
            LeaseLost: the lease can no longer be proved.
            ClockMovedBackwards: the clock went back too far; no ID was issued for the rest.
            Unavailable: the deadline passed (e.g. waiting out a recorded mark).
        """
        async with self._lock:
            ranges: list[tuple[int, int]] = []
            left = count
            while left:
                self._check_lease()
                now = self._clock.wall_ms()
                wait_ms = self._wait_until_ms
                if wait_ms is not None:
                    self._wait_until_ms = None
                    if now < wait_ms:
                        await self._sleep_ms(wait_ms - now, deadline)
                        continue
                if now > self._reserved_ms:
                    await self._await_reservation(now, deadline)
                    continue
                decision = self._core_take(now, left)
                if isinstance(decision, WaitUntil):
                    await self._sleep_ms(decision.ms - now, deadline)
                    continue
                ranges += decision.ranges
                left = decision.remaining
            if self.on_issue is not None:
                self.on_issue(tag, count)
            return IdBatch(tuple(ranges))

    def _core_take(self, now: int, count: int) -> Issued | WaitUntil:
        try:
            decision = self._state.issue(now, count)
        except ClockMovedBackwards:
            self.rollbacks_refused += 1
            raise
        if type(decision) is WaitUntil and decision.reason == "clock_back":
            self.clock_back_waits += 1
        return decision

    async def _sleep_ms(self, ms: int, deadline: float) -> None:
        self.clock_waits += 1
        if self._clock.monotonic() + ms / 1000 > deadline:
            raise Unavailable(f"snowflake IDs would need a wait of {ms} ms, past the request's deadline")
        await self._clock.sleep(ms / 1000)

    def refuse(self, error: DispenserError) -> None:
        """Issue nothing from now on: every take raises ``error`` (a live peer holds this worker's ID)."""
        self._refused = error

    @property
    def refusal(self) -> DispenserError | None:
        """Why this generator issues nothing (None: it issues)."""
        return self._refused

    def _check_lease(self) -> None:
        if self._refused is not None:
            raise self._refused.with_traceback(None)  # the same error each time; its old frames dropped
        if self._paused or not self._registry.can_issue():
            self.relocate()  # a no-op while a registration is under way
            raise LeaseLost(self._state.worker_id, "its lease can no longer be proved; re-registering")

    # -- the reserved mark -------------------------------------------------------------------------

    async def _reserve(self, now_ms: int) -> None:
        async with self._reserve_lock:
            target = now_ms + self.settings.reserve_ahead_ms
            if target <= self._reserved_ms:
                return
            try:
                await self._persist(self._state.worker_id, target)
            except OSError as exc:
                # The OSError's text names the state file (where the state directory is): the log's only.
                raise Unavailable(
                    f"cannot record the snowflake high-water mark: {type(exc).__name__}; details in the "
                    "worker's log",
                    logged=f"cannot record the snowflake high-water mark: {exc}",
                ) from exc
            self._reserved_ms = target

    def _reservation(self, now_ms: int) -> asyncio.Task[None]:
        """The reservation in progress, or a new one; a task, so that no waiter's timeout cuts it short."""
        task = self._reserving
        if task is None or task.done():
            task = self._reserving = asyncio.create_task(self._reserve(now_ms), name="snowflake-reserve")
            task.add_done_callback(_retrieve)
        return task

    async def _await_reservation(self, now_ms: int, deadline: float) -> None:
        """Wait for the mark to be recorded, but not past the deadline, nor once the lease is lost.

        A registry that hangs (ZooKeeper down: each call waits for its timeout) must not hold a request
        longer than it may wait: it gets ``lease_lost`` as soon as the lease can no longer be proved, or
        ``unavailable`` at its deadline, while the reservation goes on in the background. A reservation
        that fails (the connection to one ZooKeeper server dropped: kazoo moves to another) is tried again
        within the deadline: seen answering ``unavailable`` in the first second of a hung server while
        the lease was still good.
        """
        task = self._reservation(now_ms)
        while True:
            self._check_lease()
            left = deadline - self._clock.monotonic()
            if left <= 0:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    task.result()  # why the last try failed
                raise Unavailable(
                    "recording the snowflake high-water mark took longer than the request may wait"
                )
            if not await wait_done(self._clock, task, min(left, _LEASE_POLL)):
                continue
            if task.cancelled() or not isinstance(task.exception(), Unavailable):
                task.result()  # recorded, or an error that another try would not mend
                return
            # Could not record (ZooKeeper unreachable): once more after a pause (the same wait as for the
            # lease), if the deadline allows.
            await self._clock.sleep(min(_LEASE_POLL, max(0.0, deadline - self._clock.monotonic())))
            if deadline - self._clock.monotonic() > 0:
                task = self._reservation(now_ms)

    async def _renew_loop(self) -> None:
        # After a failed renewal, again soon (0.1 s, doubling up to the report interval): waiting a whole
        # interval let the mark run out behind a ZooKeeper server that hung, and requests then waited for a
        # reservation (measured: 1 s request timeouts for 3 s once the session had moved elsewhere).
        interval = self.settings.report_interval
        retry = Backoff(min(_RENEW_RETRY, interval), interval, clock=self._clock)
        failures = 0
        while True:
            await (retry.wait() if failures else self._clock.sleep(interval))
            try:
                await asyncio.shield(self._reservation(self._clock.wall_ms()))
            except LeaseLost:
                self.relocate()
            except (DispenserError, OSError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("renewing the snowflake high-water mark failed: %s; retrying", exc)
                else:
                    log.debug("renewing the snowflake high-water mark failed again (%d): %s", failures, exc)
                continue
            else:
                if failures:
                    log.info("renewed the snowflake high-water mark after %d failed tries", failures)
            failures = 0
            retry.reset()

    # -- losing and regaining the worker ID ----------------------------------------------------------

    def relocate(self, *, pause: bool = True) -> None:
        """Register again in the background (after a lost lease, or when started from the cache).

        Args:
            pause: issue nothing until the new registration is in place. Needed after a lost lease: the
                registry may already vouch for a *new* worker ID while this generator still holds the
                old one, which by then may be someone else's. Not needed after a start from the local
                cache in the address-keyed modes, where the cached ID stays this address's.
        """
        if pause:
            self._paused = True
        if self._relocating is None or self._relocating.done():
            self._relocating = asyncio.create_task(self._register_again(), name="snowflake-register")

    async def _register_again(self) -> None:
        backoff = Backoff(
            0.2, 1.0, clock=self._clock
        )  # cancelled on stop; 1 s: each retry is one ZooKeeper call
        while True:
            try:
                lease = await self._registry.register()
            except DispenserError as exc:  # unreachable, or no ID free yet: both may pass
                log.warning(
                    "re-registering the snowflake worker failed, retrying in %.1fs: %s", backoff.delay, exc
                )
                await backoff.wait()
                continue
            async with self._lock:
                # The same ID with a mark no higher than our own: our state already stays above everything
                # issued under it. Another ID, or a mark above ours (someone else held the ID meanwhile):
                # start a new state that honours the mark.
                if lease.worker_id != self._state.worker_id or lease.high_water_ms > max(
                    self._state.last_ms, self._reserved_ms
                ):
                    log.warning(
                        "now holding worker ID %d (was %d); issuing above %d",
                        lease.worker_id,
                        self._state.worker_id,
                        lease.high_water_ms,
                    )
                    self._state = self._new_state(lease)
                    self._wait_until_ms = None
            # Outside the lock: the write may wait for ZooKeeper up to its op timeout (a frozen server), and
            # requests must not queue behind it; they get `lease_lost` at once while still paused.
            with contextlib.suppress(DispenserError, OSError):
                await self._reserve(self._clock.wall_ms())
            self._paused = False
            return
