"""The buffered client: Leaf's double buffer, one hop further, in the caller's process.

``await client.next_id("order")`` hands out the next ID of a range the client already holds; ranges come
from the workers in the background, sized and installed by the workers' own refill engine
(:class:`~dispenser.core.refill.Refill`), of which this module is an async shell. How it buffers, retries
and what it skips: ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, Self, overload

from dispenser.adapters.nats.client import NatsIdTransport
from dispenser.client.errors import DispenserUnavailable, IdRequestError
from dispenser.config import KafkaConfig, NatsConfig
from dispenser.core.errors import InvalidTag
from dispenser.core.ids import Range
from dispenser.core.rate import RateMeter
from dispenser.core.refill import Overlap, Refill
from dispenser.core.segment import NEED_SEGMENT
from dispenser.core.step import StepPolicy
from dispenser.core.tags import validate_tag
from dispenser.messages import Format, IdRequest, Kind, Reply
from dispenser.ports import Clock, SystemClock
from dispenser.service.retry import Backoff
from dispenser.service.timing import run_within, wait_event

__all__ = ["BufferSettings", "ClientStats", "IdClient", "IdTransport", "next_run"]

log = logging.getLogger(__name__)

_RUN_SECONDS_LOW = 0.001
"""A cursor run that lasted less than this doubles the next run (up to :data:`_MAX_RUN`)."""
_RUN_SECONDS_HIGH = 0.02
"""A cursor run that lasted more than this halves the next run (down to one ID)."""
_MAX_RUN = 4096
"""The longest cursor run: the meter hears of consumption at least every this many IDs."""
_RATE_WINDOW = 1
"""Seconds per rate sample (the peak is the highest one-second average...)."""
_PEAK_RETENTION = 60.0
"""...of the last minute)."""
_START_BACKSTOP = 1.0
"""Seconds past ``timeout`` that :meth:`IdClient.start` waits for a transport that keeps no deadline itself."""


class IdTransport(Protocol):
    """How the client reaches the dispensers.

    NATS: :class:`dispenser.adapters.nats.client.NatsIdTransport`; Kafka: :class:`dispenser.client.kafka.KafkaIdTransport`.
    """

    async def start(self) -> None:
        """Connect. Raises :class:`OSError` when the broker cannot be reached."""

    async def close(self) -> None:
        """Disconnect."""

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """One request, its reply (error replies included).

        Raises:
            TimeoutError: no reply within ``timeout`` seconds.
            OSError: no worker serves the tag, or the broker cannot be reached.
        """


@dataclass(frozen=True, slots=True)
class BufferSettings:
    """How much the client holds per tag, and how long it waits."""

    buffer_seconds: float = 3.0
    """A range holds this many seconds of the client's measured rate (its peak of the last minute)."""
    min_buffer: int = 100
    """The smallest range asked for (the first one, and at low rates)."""
    max_buffer: int = 1_000_000
    """The largest range asked for (the workers' ``limits.max_ranges`` caps a request anyway)."""
    max_request: int = 1_000_000
    """The most IDs one request asks for (the workers' ``limits.max_ranges``); a bigger ``take`` needs several."""
    timeout: float = 5.0
    """Seconds a call waits for IDs when the buffer is empty and no outage is known yet."""
    request_timeout: float = 3.0
    """Seconds a request waits for its reply (above the workers' ``segment.fetch_deadline``, 2 s)."""
    retry_initial: float = 0.05
    """First pause after a refill failed, doubling up to ``retry_max``."""
    retry_max: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer_seconds <= 0:
            raise ValueError(f"buffer_seconds must be positive, got {self.buffer_seconds}")
        if not 1 <= self.min_buffer <= self.max_buffer:
            raise ValueError(f"need 1 <= min_buffer <= max_buffer, got {self.min_buffer}, {self.max_buffer}")
        if self.max_request < 1:
            raise ValueError(f"max_request must be at least 1, got {self.max_request}")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What one tag cost (segment kind), since the client started."""

    tag: str
    requests: int
    """Requests sent to the workers for refills (retries included)."""
    ids_received: int
    """IDs in the ranges received (those dropped included)."""
    ids_dropped: int
    """IDs received below those already held (a worker behind another), skipped."""
    ids_held: int
    """IDs in hand now (cursor and buffer): skipped if the client exits."""
    last_range: int | None
    """The size of the last range asked for."""

    @property
    def ids_handed_out(self) -> int:
        """IDs returned to callers."""
        return self.ids_received - self.ids_dropped - self.ids_held


class _Tag:
    """One tag's cursor and refill engine (segment kind)."""

    __slots__ = (
        "changed",
        "end",
        "engine",
        "failure",
        "fatal",
        "fatal_round",
        "ids_dropped",
        "ids_received",
        "name",
        "position",
        "refiller",
        "requests",
        "round",
        "run",
        "run_at",
    )

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.position = 1  # the cursor: position > end means empty
        self.end = 0
        self.engine = Refill(
            RateMeter(now, window=_RATE_WINDOW, retention=_PEAK_RETENTION),
            prefetch_threshold=0.0,
            overlap=Overlap.SKIP,  # two workers answer from two segments: one may be behind
        )
        self.changed = asyncio.Event()
        self.refiller: asyncio.Task[None] | None = None
        self.round = 0  # refills started
        self.failure: DispenserUnavailable | None = None  # the outage the refill is retrying through
        self.fatal: IdRequestError | None = None  # a non-retryable answer that ended refill ``fatal_round``
        self.fatal_round = 0
        self.run = 1  # the next cursor run's length
        self.run_at = now
        self.requests = 0
        self.ids_received = 0
        self.ids_dropped = 0

    def in_cursor(self) -> int:
        return self.end - self.position + 1

    def held(self) -> int:
        return self.end - self.position + 1 + self.engine.remaining

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


def next_run(run: int, lasted: float, fast: float = _RUN_SECONDS_LOW, slow: float = _RUN_SECONDS_HIGH) -> int:
    """The length of a cursor's next run, from how long its last run of ``run`` IDs lasted.

    Doubled (up to :data:`_MAX_RUN`) when it went in under ``fast`` seconds, halved (down to 1) past
    ``slow``: a busy caller comes back for more rarely, a quiet one holds few IDs it may never use.
    """
    if lasted < fast:
        return min(run * 2, _MAX_RUN)
    if lasted > slow:
        return max(run // 2, 1)
    return run


class IdClient:
    """IDs from the dispensers, buffered per tag in this process; one instance serves any number of tasks.

    Args:
        transport: how to reach the dispensers (see :meth:`over_nats`, :meth:`over_kafka`).
        settings: buffer sizes and timeouts.
        clock: whose time rates, timeouts and pauses are (default: the system's; tests pass a
            :class:`~dispenser.testing.ManualClock`).

    Example::

        async with IdClient.over_nats(NatsConfig(url="nats://127.0.0.1:4222")) as client:
            order_id = await client.next_id("order")
            ids = await client.take("order", 1000)
    """

    def __init__(
        self, transport: IdTransport, settings: BufferSettings | None = None, clock: Clock | None = None
    ) -> None:
        self.transport = transport
        self.settings = settings or BufferSettings()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._policy = StepPolicy(
            segment_seconds=self.settings.buffer_seconds, max_step=self.settings.max_buffer, hysteresis=0.25
        )
        self._tags: dict[str, _Tag] = {}
        self._closed = False

    @classmethod
    def over_nats(
        cls, config: NatsConfig | str | None = None, settings: BufferSettings | None = None
    ) -> Self:
        """A client over NATS (connects on :meth:`start`).

        Args:
            config: servers and credentials, or just a server URL; default ``nats://127.0.0.1:4222``.
            settings: buffer sizes and timeouts.
        """
        if isinstance(config, str):
            config = NatsConfig(url=config)
        settings = settings or BufferSettings()
        return cls(NatsIdTransport(config, name="leaf-id-client", start_deadline=settings.timeout), settings)

    @classmethod
    def over_kafka(
        cls,
        config: KafkaConfig | None = None,
        settings: BufferSettings | None = None,
        *,
        reply_topic: str | None = None,
    ) -> Self:
        """A client over Kafka (connects on :meth:`start`; the reply topic must exist).

        Args:
            config: servers and credentials, ``request_topic`` and ``reply_topic``.
            settings: buffer sizes and timeouts.
            reply_topic: where replies should come (default: ``config.reply_topic``).
        """
        # Imported here: aiokafka is the [kafka] extra, and a NATS-only client needs none of it.
        from dispenser.client.kafka import KafkaIdTransport  # noqa: PLC0415

        return cls(KafkaIdTransport(config, reply_topic=reply_topic), settings)

    async def start(self) -> None:
        """Connect, within ``settings.timeout`` (the NATS transport's own deadline; a second more for others).

        Raises:
            DispenserUnavailable: the broker cannot be reached (``code="unreachable"``), or did not answer in
                time (``"timeout"``); the message names the broker and the cause.
        """
        timeout = self.settings.timeout
        try:
            # The NATS transport gives up at `timeout` by itself, with the cause; this bounds any transport.
            await run_within(self.clock, self.transport.start(), timeout + _START_BACKSTOP)
        except TimeoutError:
            raise DispenserUnavailable("timeout", f"the broker did not answer within {timeout:g} s") from None
        except OSError as exc:
            raise DispenserUnavailable("unreachable", str(exc) or type(exc).__name__) from None

    async def close(self) -> None:
        """Stop refilling and disconnect. IDs still held are skipped, never handed out by anyone."""
        self._closed = True
        tasks = [state.refiller for state in self._tags.values() if state.refiller is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.transport.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- the hot path ------------------------------------------------------------------------------

    async def next_id(self, tag: str, kind: Kind = "segment") -> int:
        """The next ID of ``tag``: strictly above every ID this client handed out for ``tag`` before.

        Raises:
            DispenserUnavailable: the buffer is empty and no worker answers (retryable).
            IdRequestError: the workers refused (``unknown_tag``, ``invalid_tag``, …): not retryable.
        """
        state = self._tags.get(tag)
        if state is not None and kind == "segment":
            position = state.position
            if position <= state.end:
                state.position = position + 1
                return position
        return await self._next_id_slow(tag, kind)

    @overload
    async def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Literal["ids"] = "ids"
    ) -> list[int]: ...

    @overload
    async def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Literal["ranges"]
    ) -> list[Range]: ...

    async def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Format = "ids"
    ) -> list[int] | list[Range]:
        """``count`` IDs of ``tag``, increasing: a list (``format="ids"``) or inclusive ranges (``"ranges"``).

        Segment IDs come from the buffer (and are above every ID this client handed out before); snowflake
        IDs are one request.

        Raises:
            ValueError: ``count`` < 1.
            DispenserUnavailable: not enough IDs held and no worker answers (retryable).
            IdRequestError: the workers refused: not retryable.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if kind != "segment":
            ranges = await self._request_direct(kind, tag, count)
        else:
            state = self._tags.get(tag)
            if state is not None and (position := state.position) + count - 1 <= state.end:
                state.position = position + count
                if format == "ids":
                    return list(range(position, position + count))
                return [(position, position + count - 1)]
            ranges = await self._take_slow(tag, count)
        if format == "ids":
            return [i for first, last in ranges for i in range(first, last + 1)]
        return list(ranges)

    async def take_run(self, tag: str, limit: int) -> Range:
        """Between 1 and ``limit`` IDs of ``tag`` as one range, for a cursor of the caller's own.

        The blocking client keeps one per tag this way. Raises as :meth:`next_id`.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        state = self._state(tag)
        while True:
            first = state.position
            if first <= state.end:
                last = min(state.end, first + limit - 1)
                state.position = last + 1
                return (first, last)
            if not self._refill_cursor(state):
                await self._wait(state, 1)

    def stats(self, tag: str) -> ClientStats | None:
        """What ``tag`` cost so far (segment kind), or ``None`` if it was never asked for."""
        state = self._tags.get(tag)
        if state is None:
            return None
        return ClientStats(
            tag=tag,
            requests=state.requests,
            ids_received=state.ids_received,
            ids_dropped=state.ids_dropped,
            ids_held=state.held(),
            last_range=state.engine.last_size,
        )

    # -- the slow path -----------------------------------------------------------------------------

    def _state(self, tag: str) -> _Tag:
        state = self._tags.get(tag)
        if state is None:
            if self._closed:
                raise RuntimeError("the client is closed")
            _check_tag(tag)
            state = self._tags[tag] = _Tag(tag, self.clock.monotonic())
        return state

    async def _next_id_slow(self, tag: str, kind: Kind) -> int:
        if kind != "segment":
            ranges = await self._request_direct(kind, tag, 1)
            return ranges[0][0]
        state = self._state(tag)
        while True:
            if state.position <= state.end:  # refilled while we waited
                position = state.position
                state.position = position + 1
                return position
            if self._refill_cursor(state):
                continue
            await self._wait(state, 1)

    def _refill_cursor(self, state: _Tag) -> bool:
        """Move the next run from the buffer into the empty cursor; false if the buffer is empty too."""
        now = self.clock.monotonic()
        state.run = next_run(state.run, now - state.run_at)
        engine = state.engine
        run = engine.take_run(state.run, now)
        if engine.wants_fetch:
            self._start_refill(state)
        if run is NEED_SEGMENT:
            return False
        state.position, state.end = run
        state.run_at = now
        return True

    async def _take_slow(self, tag: str, count: int) -> list[Range]:
        state = self._state(tag)
        engine = state.engine
        while True:
            in_cursor = state.in_cursor()
            if in_cursor + engine.remaining >= count:
                ranges: list[Range] = []
                rest = count
                if in_cursor > 0:
                    ranges.append((state.position, state.end))
                    rest -= in_cursor
                    state.position = state.end + 1
                batch = engine.take(rest, self.clock.monotonic())
                assert batch is not NEED_SEGMENT  # checked above
                if engine.wants_fetch:
                    self._start_refill(state)
                for first, last in batch.ranges:
                    if ranges and ranges[-1][1] + 1 == first:
                        ranges[-1] = (ranges[-1][0], last)
                    else:
                        ranges.append((first, last))
                return ranges
            await self._wait(state, count)

    async def _wait(self, state: _Tag, count: int) -> None:
        """Wait until ``count`` IDs are held or the refill ended; raise what says there will be none.

        Raises:
            DispenserUnavailable: an outage is known (the refill is retrying through it: new callers get it
                at once, waiting ones unless it is a reply that timed out and is being asked again), or
                nothing came within ``timeout``.
            IdRequestError: the refill this call waited for was refused.
        """
        if self._closed:
            raise RuntimeError("the client is closed")
        if state.failure is not None:
            raise state.failure
        state.engine.need(count)
        if state.refiller is None:
            self._start_refill(state)
        waiting_for = state.round
        clock = self.clock
        deadline = clock.monotonic() + self.settings.timeout
        while True:
            if not await wait_event(clock, state.changed, deadline - clock.monotonic()):
                raise DispenserUnavailable(
                    "timeout", f"no IDs of {state.name!r} within {self.settings.timeout:g} s"
                ) from None
            if state.fatal is not None and state.fatal_round == waiting_for:
                raise state.fatal
            if state.held() >= count or state.refiller is None:
                return
            failure = state.failure
            if failure is not None and failure.code != "timeout":
                raise failure

    def _start_refill(self, state: _Tag) -> None:
        if state.refiller is not None or self._closed:
            return
        state.engine.start()
        state.round += 1
        state.fatal = None
        state.refiller = asyncio.create_task(self._refill(state), name=f"id-client-refill-{state.name}")

    def _range_size(self, state: _Tag, now: float) -> int:
        """The next range: ``buffer_seconds`` of the measured rate, by the workers' own step policy."""
        engine = state.engine
        step = engine.step(self._policy, self.settings.min_buffer, engine.own_view(now))
        size = engine.size(step, outside=state.in_cursor(), cap=self.settings.max_request)
        assert size is not None  # a step is given
        return size

    async def _refill(self, state: _Tag) -> None:
        settings = self.settings
        backoff = Backoff(settings.retry_initial, settings.retry_max, clock=self.clock, jitter=0.2)
        engine = state.engine
        dropped_in_a_row = 0
        try:
            while True:
                count = self._range_size(state, self.clock.monotonic())  # a source behind: the gap too
                request = IdRequest(count=count, request_id=uuid.uuid4().hex, format="ranges")
                reply = await self._attempts(state, request, backoff)
                if reply is None:  # refused: no retry
                    return
                assert reply.ranges is not None
                arrival = engine.arrive(reply.ranges, self.clock.monotonic(), asked=count)
                state.ids_received += arrival.received
                state.ids_dropped += arrival.dropped
                state.failure = None
                backoff.reset()
                if arrival.admitted and engine.satisfied(outside=state.in_cursor()):
                    return
                # All of it below what we hold (a worker behind another), or a take needs more: again.
                if arrival.admitted:
                    dropped_in_a_row = 0
                    engine.again()
                    state.notify()
                else:
                    dropped_in_a_row += 1
                    if dropped_in_a_row > 2:  # not one worker behind: the tag's counter went back (by hand?)
                        log.warning(
                            "refill of %r: %d ranges in a row below the IDs held",
                            state.name,
                            dropped_in_a_row,
                        )
                        await backoff.wait()
        finally:
            state.refiller = None
            state.notify()

    async def _attempts(self, state: _Tag, request: IdRequest, backoff: Backoff) -> Reply | None:
        """Send ``request`` until it is answered with IDs (same ``request_id``: a lost reply costs no range).

        Returns ``None`` when the workers refused it (``state.fatal`` says why).
        """
        engine = state.engine
        while True:
            state.requests += 1
            engine.attempt(self.clock.monotonic())
            try:
                reply = await self.transport.request(
                    "segment", state.name, request, self.settings.request_timeout
                )
            except TimeoutError as exc:
                failure = DispenserUnavailable("timeout", f"{state.name!r}: {exc or 'no reply in time'}")
            except OSError as exc:
                failure = DispenserUnavailable("unreachable", f"{state.name!r}: {exc}")
            except Exception as exc:  # a bug, not an outage: say so loudly, and keep trying
                log.exception("refill of %r failed unexpectedly", state.name)
                failure = DispenserUnavailable("unavailable", f"{state.name!r}: {type(exc).__name__}: {exc}")
            else:
                error = reply.error
                if error is None and reply.ranges:
                    return reply
                if error is None:
                    failure = DispenserUnavailable("unavailable", f"{state.name!r}: a reply without ranges")
                elif error.retryable:
                    failure = DispenserUnavailable(error.code, error.message)
                else:
                    engine.give_up()
                    state.fatal = IdRequestError(error.code, error.message, False)
                    state.fatal_round = state.round
                    return None
            if state.failure is None:
                log.warning("refill of %r failed, retrying until a worker answers: %s", state.name, failure)
            state.failure = failure
            engine.failed()
            state.notify()
            await backoff.wait()
            engine.start()

    async def _request_direct(self, kind: Kind, tag: str, count: int) -> list[Range]:
        """One request, not buffered (snowflake IDs); a lost reply is asked again with the same ``request_id``."""
        _check_tag(tag)
        request = IdRequest(count=count, request_id=uuid.uuid4().hex, format="ranges")
        deadline = self.clock.monotonic() + self.settings.timeout
        while True:
            try:
                reply = await self.transport.request(kind, tag, request, self.settings.request_timeout)
            except TimeoutError as exc:
                if self.clock.monotonic() < deadline:
                    continue
                raise DispenserUnavailable("timeout", f"{tag!r}: {exc or 'no reply in time'}") from None
            except OSError as exc:
                raise DispenserUnavailable("unreachable", f"{tag!r}: {exc}") from None
            if reply.error is not None:
                if reply.error.retryable:
                    raise DispenserUnavailable(reply.error.code, reply.error.message)
                raise IdRequestError(reply.error.code, reply.error.message, False)
            if not reply.ranges:
                raise DispenserUnavailable("unavailable", f"{tag!r}: a reply without ranges")
            return [(first, last) for first, last in reply.ranges]


def _check_tag(tag: str) -> None:
    """Refuse a tag name no worker would accept, as they would (``invalid_tag``), before any request.

    A name that is no NATS subject token ("bad tag!") would otherwise fail in the transport, look like an
    outage, and be retried in the background for ever.
    """
    try:
        validate_tag(tag)
    except InvalidTag as exc:
        raise IdRequestError(InvalidTag.code, str(exc), False) from None
