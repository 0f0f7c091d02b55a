"""One tag's refill, written once: the single fetch in flight, its waiters, back-off, and an outage's log lines.

The engine (:class:`~dispenser.core.refill.Refill`) decides; a :class:`Refiller` acts on its decisions
against a :class:`RangeSource`: the store for the worker (``service/segments.py``: residue check, an
overlap refused), the workers for the buffered client (``client/buffered.py``: ``request_id``, an overlap
skipped). See ``docs/segment.md`` ("The refill engine").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from dispenser.core.refill import IDLE, Again, Done, Fetch, Refill, Stop
from dispenser.ports import Clock
from dispenser.service.retry import Backoff
from dispenser.service.timing import wait_event

__all__ = ["RangeSource", "Refiller", "Refused"]


class Refused(Exception):
    """Raised by :meth:`RangeSource.fetch` when no retry can help: the fetch ends, and so do its waits.

    ``error`` is what the waiters are told (:attr:`Refiller.refused`).
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class RangeSource(Protocol):
    """Where one tag's ranges come from, and what the tag's owner records of each attempt."""

    log: logging.Logger
    """Where the refill's lines go (the owner's logger)."""
    subject: str
    """The refill in a log line: ``"segment fetch for 'order'"``."""
    peer: str
    """Who answers it: ``"the store"``."""
    outages: tuple[type[Exception], ...]
    """The failures that are an outage: retried, logged without a traceback. Any other is a bug: logged
    with its traceback, retried all the same, and shown to waiters as :meth:`unexpected`'s error."""

    def step(self) -> int | None:
        """The step policy's size for the next fetch (``None``: the source's own default)."""
        ...

    def outside(self) -> int:
        """IDs the owner holds outside the engine's buffer (the client's cursor; 0 for the worker)."""
        ...

    async def fetch(self, fetch: Fetch) -> Sequence[tuple[int, int]]:
        """One attempt: the ranges granted for ``fetch``.

        Raises:
            Refused: no retry can help.
            Exception: anything else is retried after the back-off.
        """
        ...

    def unexpected(self, exc: Exception) -> Exception:
        """The error waiters see for a failure that is no outage (a bug)."""
        ...

    def failed(self, error: Exception) -> None:
        """An attempt failed with ``error`` (an outage's, or :meth:`unexpected`'s); it is retried."""
        ...

    def arrived(self, outcome: Done | Again) -> None:
        """A reply was installed (or all of it skipped)."""
        ...

    def stopped(self, stop: Stop) -> None:
        """The engine refused a reply (an overlap from one store row): nothing of it is served."""
        ...


class Refiller:
    """Acts on one tag's engine: one fetch task at a time, waiters woken at each change, back-off on failure.

    Args:
        engine: the tag's refill engine.
        source: where ranges come from.
        clock: whose time the back-off and the waits are.
        retry_initial: the first back-off (seconds), doubling up to ``retry_max``.
        retry_max: the longest back-off.
        name: the fetch task's name.
        jitter: see :attr:`jitter`.
    """

    def __init__(
        self,
        engine: Refill,
        source: RangeSource,
        clock: Clock,
        *,
        retry_initial: float,
        retry_max: float,
        name: str,
        jitter: float = 0.2,
    ) -> None:
        self.engine = engine
        self.source = source
        self.clock = clock
        self.name = name
        self.failure: Exception | None = None
        """The outage the fetch is retrying through (``None``: the last attempt was answered)."""
        self.failures = 0
        """Failed attempts in the current outage."""
        self.refused: Exception | None = None
        """Why the fetch of :attr:`round` was refused (``None``: it was not, or it is still going)."""
        self.round = 0
        """Fetches begun."""
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        """The fetch in flight (``None``: none)."""
        self.jitter = jitter
        """Each back-off's random factor lies within ``1 ± jitter`` (so that workers failing together do not
        retry in the same instant; tests set 0 to count attempts exactly)."""
        self._retry = (retry_initial, retry_max)
        self._failing_since = 0.0
        self._changed = asyncio.Event()

    def kick(self) -> None:
        """Begin a fetch, unless one is in flight or the refiller is closed."""
        if self.task is None and not self.closed:
            self.engine.begin()
            self.round += 1
            self.refused = None
            self.task = asyncio.create_task(self._run(), name=self.name)

    def notify(self) -> None:
        """Wake every waiter at once; each checks again what it waits for."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, deadline: float) -> bool:
        """Wait for the next change (a range installed, a failure, the fetch's end) until ``deadline``.

        Returns:
            Whether a change came (``False``: the deadline, monotonic seconds of the clock, passed first).
        """
        remaining = deadline - self.clock.monotonic()
        if remaining <= 0:
            return False
        return await wait_event(self.clock, self._changed, remaining)

    async def close(self) -> None:
        """Stop fetching (the task is cancelled); no fetch begins after."""
        self.closed = True
        task = self.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        """The fetch: attempts until the engine is satisfied, gives up, or stops."""
        engine, source, clock = self.engine, self.source, self.clock
        backoff = Backoff(*self._retry, clock=clock, jitter=self.jitter)
        try:
            while (
                fetch := engine.next(clock.monotonic(), source.step, outside=source.outside())
            ) is not IDLE:
                try:
                    ranges = await source.fetch(fetch)
                except Refused as refused:
                    self.refused = refused.error
                    engine.on_failure(final=True)  # the loop ends
                    continue
                except Exception as exc:
                    engine.on_failure()
                    self._failed(exc, backoff.delay)
                    self.notify()
                    await backoff.wait()
                    continue
                outcome = engine.on_reply(ranges, clock.monotonic(), outside=source.outside())
                if isinstance(outcome, Stop):
                    source.stopped(outcome)  # the loop ends
                    continue
                self._answered()
                backoff.reset()
                source.arrived(outcome)
                if isinstance(outcome, Again):
                    if outcome.arrival.admitted:
                        self.notify()  # a take needs more than arrived: those that fit now go
                    if outcome.pause:  # not one source behind: the tag's counter went back (by hand?)
                        source.log.warning(
                            "%s: %d ranges in a row below the IDs held",
                            source.subject,
                            outcome.skipped_in_a_row,
                        )
                        await backoff.wait()
        finally:
            engine.abandon()  # idle again whatever ended the task (cancelled, or a bug of the source's)
            self.task = None
            self.notify()

    def _failed(self, exc: Exception, delay: float) -> None:
        """Record a failed attempt and say so, once per outage.

        One line per outage (a failover retries for seconds): the first failure at WARNING, the retries at
        DEBUG, then one line when it recovers (:meth:`_answered`). Called while ``exc`` is being handled.
        """
        source = self.source
        first = self.failure is None
        if first:
            self._failing_since = self.clock.monotonic()
            self.failures = 0
        self.failures += 1
        if isinstance(exc, source.outages):
            error: Exception = exc
            level = logging.WARNING if first else logging.DEBUG
            source.log.log(
                level, "%s failed, retrying until %s answers: %s", source.subject, source.peer, exc
            )
        else:  # a bug, not an outage: say so loudly, but keep the tag alive
            error = source.unexpected(exc)
            source.log.exception("%s failed unexpectedly; retrying in %.2fs", source.subject, delay)
        self.failure = error
        source.failed(error)

    def _answered(self) -> None:
        """An attempt was answered: the outage, if any, is over (the line that ends :meth:`_failed`'s)."""
        if self.failure is not None:
            self.source.log.info(
                "%s recovered after %d failed attempt(s) in %.1f s",
                self.source.subject,
                self.failures,
                self.clock.monotonic() - self._failing_since,
            )
        self.failure = None
