"""The buffered client: Leaf's double buffer, one hop further, in the caller's process.

``await client.next_id("order")`` hands out the next ID of a range the client already holds; ranges come
from the workers in the background, sized and installed by the workers' own refill engine
(:class:`~dispenser.core.refill.Refill`) through the workers' own refill shell
(:class:`~dispenser.service.refiller.Refiller`); this module adds the cursor and the transport's side.
A permuted tag's IDs, which make no ranges, are kept as a list (:mod:`dispenser.client.listed`). How it
buffers, retries and what it skips: ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from operator import length_hint
from types import TracebackType
from typing import Final, Literal, Self, overload

from dispenser.adapters.nats.client_transport import NatsIdTransport
from dispenser.client.errors import DispenserUnavailable, IdRequestError
from dispenser.client.listed import (
    FIRST_POSITION,
    PERMUTED_REQUEST_MAX,
    REQUESTS_IN_FLIGHT,
    Listed,
    ListedRequests,
    ids_of,
    may_be_permuted,
)
from dispenser.client.settings import BufferSettings, ClientStats, IdTransport, next_run
from dispenser.config import KafkaConfig, NatsConfig
from dispenser.core.errors import InvalidTag
from dispenser.core.ids import Range
from dispenser.core.rate import RateMeter
from dispenser.core.refill import Again, Done, Fetch, Overlap, Refill, Stop
from dispenser.core.segment import NEED_SEGMENT
from dispenser.core.step import StepPolicy
from dispenser.core.tags import validate_tag
from dispenser.messages import Format, IdRequest, Kind, Reply
from dispenser.ports import Clock, SystemClock
from dispenser.service.refiller import Refiller, Refused
from dispenser.service.timing import run_within

__all__ = ["BufferSettings", "ClientStats", "IdClient", "IdTransport", "next_run"]

log = logging.getLogger(__name__)

_RATE_WINDOW = 1
"""Seconds per rate sample (the peak is the highest one-second average...)."""
_PEAK_RETENTION = 60.0
"""...of the last minute)."""
_START_BACKSTOP = 1.0
"""Seconds past ``timeout`` that :meth:`IdClient.start` waits for a transport that keeps no deadline itself."""


_SEGMENT: Final = "segment"
"""next_id's default kind, tested by identity on the hot path (an equal string built at run time goes slow)."""


class _Tag:
    """One tag's cursor, refill engine and refill shell (segment kind)."""

    __slots__ = (
        "cursor",
        "cursors",
        "end",
        "engine",
        "ids_dropped",
        "ids_received",
        "listed",
        "name",
        "refiller",
        "requests",
        "run",
        "run_at",
    )

    def __init__(self, name: str, client: IdClient) -> None:
        settings = client.settings
        now = client.clock.monotonic()
        self.name = name
        self.cursors = client._cursors
        self.listed: Listed | None = None
        """A permuted tag's IDs (the engine then holds their positions); ``None``: a plain tag's."""
        self.cursor: Iterator[int] = iter(())
        self.end = 0
        self.set_cursor(1, 0)  # empty
        self.engine = Refill(
            RateMeter(now, window=_RATE_WINDOW, retention=_PEAK_RETENTION),
            prefetch_threshold=0.0,
            overlap=Overlap.SKIP,  # two workers answer from two segments: one may be behind
            # The first request asks no more than a permuted tag's may: the reply says which the tag is.
            cap=min(settings.max_request, PERMUTED_REQUEST_MAX),
            repeat_on_retry=True,  # a lost reply is asked for again by its request_id: the same range
        )
        self.refiller = Refiller(
            self.engine,
            _Workers(self, client),
            client.clock,
            retry_initial=settings.retry_initial,
            retry_max=settings.retry_max,
            name=f"id-client-refill-{name}",
        )
        self.run = 1  # the next cursor run's length
        self.run_at = now
        self.requests = 0
        self.ids_received = 0
        self.ids_dropped = 0

    @property
    def position(self) -> int:
        """The cursor's next position (a plain tag's: its next ID); above :attr:`end` when it is empty."""
        return self.end + 1 - length_hint(self.cursor)

    @position.setter
    def position(self, first: int) -> None:
        self.set_cursor(first, self.end)

    def set_cursor(self, first: int, last: int) -> None:
        """The cursor hands out the IDs at ``first`` to ``last`` next: next_id calls ``next()`` on it.

        A plain tag's: a range iterator. A permuted tag's: a list iterator over the IDs at those positions,
        which costs the same.
        """
        self.end = last
        listed = self.listed
        if listed is None or first < FIRST_POSITION:  # plain IDs (those held when the tag became permuted)
            self.cursor = iter(range(first, last + 1))
        else:
            self.cursor = iter(listed.ids(first, last))
        self.cursors[self.name] = self.cursor

    def runs(self, first: int, last: int) -> list[Range]:
        """The IDs at positions ``first`` to ``last`` as ranges: one, or a permuted tag's one per ID."""
        listed = self.listed
        if listed is None or first < FIRST_POSITION:
            return [(first, last)]
        return [(i, i) for i in listed.ids(first, last)]

    def in_cursor(self) -> int:
        return length_hint(self.cursor)

    def held(self) -> int:
        return length_hint(self.cursor) + self.engine.remaining


class _Workers:
    """The client's :class:`~dispenser.service.refiller.RangeSource`: one tag's ranges from the workers."""

    outages: tuple[type[Exception], ...] = (IdRequestError,)
    peer = "a worker"

    def __init__(self, state: _Tag, client: IdClient) -> None:
        self._state = state
        self._client = client
        self._request: IdRequest | None = None
        self._listed: ListedRequests | None = None  # a permuted tag's
        self._capped = False  # a request over PERMUTED_REQUEST_MAX was refused: no more such requests
        self.log = log
        self.subject = f"refill of {state.name!r}"

    def step(self) -> int:
        """``buffer_seconds`` of the measured rate, by the workers' own step policy."""
        client = self._client
        engine = self._state.engine
        return engine.step(
            client._policy, client.settings.min_buffer, engine.own_view(client.clock.monotonic())
        )

    def outside(self) -> int:
        """The cursor's IDs."""
        return self._state.in_cursor()

    async def fetch(self, fetch: Fetch) -> list[tuple[int, int]]:
        """One request (a retry: the same, with its ``request_id``), or a permuted tag's :class:`ListedRequests`.

        Raises:
            DispenserUnavailable: no reply, no worker, or a retryable error reply.
            Refused: a non-retryable error reply (an :class:`IdRequestError`).
        """
        if (listed := self._state.listed) is not None and self._listed is not None:
            return [listed.add(*await self._listed.fetch(fetch, self.send))]
        request = self._request
        if request is None or not fetch.repeat:
            assert fetch.size is not None  # the client always gives a step
            request = self._request = _ranges(fetch.size)
        try:
            reply = await self.send(request)
        except Refused as refused:
            if not may_be_permuted(refused, request):
                raise
            # tag set --permuted under this client? A permuted tag's request gets at most 10,000 IDs.
            request = self._request = _ranges(PERMUTED_REQUEST_MAX)
            reply = await self.send(request)
            self._capped = True
        if reply.permuted:  # the tag's first permuted reply: from here on, a list
            return [self._permuted(reply)]
        if not reply.ranges:
            raise DispenserUnavailable("unavailable", f"{self._state.name!r}: a reply without ranges")
        if not self._capped:  # a plain tag: no more the first request's cap
            self._state.engine.cap = self._client.settings.max_request
        return reply.ranges

    def _permuted(self, reply: Reply) -> Range:
        """A reply says the tag is permuted: keep its IDs as a list from now on, the plain ones held below."""
        state = self._state
        settings = self._client.settings
        # No order guard on the IDs (the engine's, on their positions, never skips one): each is a counter
        # the store granted once (it guards the counters), put through a bijection.
        listed = state.listed = Listed()
        self._listed = ListedRequests(state.name, min(settings.max_request, PERMUTED_REQUEST_MAX))
        state.engine.cap = min(settings.max_request, PERMUTED_REQUEST_MAX * REQUESTS_IN_FLIGHT)
        return listed.add(ids_of(reply))

    async def send(self, request: IdRequest) -> Reply:
        """One request and its reply, which has IDs (in ranges or a list).

        Raises:
            DispenserUnavailable: no reply, no worker, or a retryable error reply.
            Refused: a non-retryable error reply (an :class:`IdRequestError`).
        """
        state = self._state
        state.requests += 1
        name = state.name
        client = self._client
        try:
            reply = await client.transport.request("segment", name, request, client.settings.request_timeout)
        except TimeoutError as exc:
            raise DispenserUnavailable("timeout", f"{name!r}: {exc or 'no reply in time'}") from None
        except OSError as exc:
            raise DispenserUnavailable("unreachable", f"{name!r}: {exc}") from None
        error = reply.error
        if error is None and (reply.ranges or reply.ids):
            return reply
        if error is None:
            raise DispenserUnavailable("unavailable", f"{name!r}: a reply without IDs")
        if error.retryable:
            raise DispenserUnavailable(error.code, error.message)
        raise Refused(IdRequestError(error.code, error.message, False))

    def unexpected(self, exc: Exception) -> Exception:
        """A bug, not an outage: what the callers see while the refill keeps trying."""
        return DispenserUnavailable("unavailable", f"{self._state.name!r}: {type(exc).__name__}: {exc}")

    def failed(self, error: Exception) -> None:
        """Nothing to count: the refiller's ``failure`` is what callers are told."""

    def arrived(self, outcome: Done | Again) -> None:
        """Count what arrived and what was skipped."""
        self._state.ids_received += outcome.arrival.received
        self._state.ids_dropped += outcome.arrival.dropped

    def stopped(self, stop: Stop) -> None:
        """Never: the client skips an overlap (``Overlap.SKIP``) rather than refusing it."""
        log.error("refill of %r stopped: %s", self._state.name, stop.reason)


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
        self._cursors: dict[str, Iterator[int]] = {}  # each tag's _Tag.cursor: next_id's
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
        from dispenser.adapters.kafka.client_transport import KafkaIdTransport  # noqa: PLC0415

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
        await asyncio.gather(*(state.refiller.close() for state in self._tags.values()))
        await self.transport.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- the hot path ------------------------------------------------------------------------------

    async def next_id(self, tag: str, kind: Kind = _SEGMENT) -> int:
        """The next ID of ``tag``: above every ID handed out for it before (a permuted tag's: new, in no order).

        Raises:
            DispenserUnavailable: the buffer is empty and no worker answers (retryable).
            IdRequestError: the workers refused (``unknown_tag``, ``invalid_tag``, …): not retryable.
        """
        # The hot path: the cursor is a range iterator, which counts and checks the end in one C call (~20 ns
        # less than reading, comparing and writing back two ints); through next() rather than its bound
        # __next__, ~12 ns less again (a method-wrapper's call costs more; dispenser bench client).
        try:
            if kind is _SEGMENT:
                return next(self._cursors[tag])
        except (KeyError, StopIteration):  # a tag not asked for before, or its cursor ran out
            pass
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
        """``count`` IDs of ``tag``, a list (``format="ids"``) or inclusive ranges (``"ranges"``).

        Segment IDs come from the buffer (and are above every ID this client handed out before; a permuted
        tag's are in no order, one range per ID); snowflake IDs are one request.

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
                if state.listed is None:
                    state.position = position + count
                    if format == "ids":
                        return list(range(position, position + count))
                    return [(position, position + count - 1)]
                ranges = state.runs(position, position + count - 1)
                state.position = position + count
            else:
                ranges = await self._take_slow(tag, count)
        if format == "ids":
            return [i for first, last in ranges for i in range(first, last + 1)]
        return list(ranges)

    async def take_run(self, tag: str, limit: int) -> Range:
        """Between 1 and ``limit`` IDs of ``tag`` as one range, for a cursor of the caller's own.

        A permuted tag's IDs make no range: one a call, ``(id, id)`` (:meth:`take_block` gives more). Raises
        as :meth:`next_id`.
        """
        ids = await self._block(tag, limit, 1)
        return (ids[0], ids[-1])

    async def take_block(self, tag: str, limit: int) -> range | list[int]:
        """Between 1 and ``limit`` IDs of ``tag``, for a cursor of the caller's own.

        A plain tag's as a range (increasing), a permuted tag's as a list. The blocking client keeps one per
        tag this way. Raises as :meth:`next_id`.
        """
        return await self._block(tag, limit, limit)

    async def _block(self, tag: str, limit: int, listed_limit: int) -> range | list[int]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        state = self._state(tag)
        while (first := state.position) > state.end:
            if not self._refill_cursor(state):
                await self._wait(state, 1)
        listed = state.listed
        if listed is None or first < FIRST_POSITION:
            last = min(state.end, first + limit - 1)
            ids: range | list[int] = range(first, last + 1)
        else:
            last = min(state.end, first + listed_limit - 1)
            ids = listed.ids(first, last)
        state.position = last + 1
        return ids

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
            state = self._tags[tag] = _Tag(tag, self)
        return state

    async def _next_id_slow(self, tag: str, kind: Kind) -> int:
        if kind != "segment":
            ranges = await self._request_direct(kind, tag, 1)
            return ranges[0][0]
        state = self._state(tag)
        while True:
            if state.position <= state.end:  # refilled while we waited
                return next(state.cursor)
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
        state.set_cursor(*run)
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
                    ranges += state.runs(state.position, state.end)
                    rest -= in_cursor
                    state.set_cursor(state.end + 1, state.end)
                batch = engine.take(rest, self.clock.monotonic())
                assert batch is not NEED_SEGMENT  # checked above
                if engine.wants_fetch:
                    self._start_refill(state)
                for positions in batch.ranges:
                    for first, last in state.runs(*positions):
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
        refiller = state.refiller
        if refiller.failure is not None:
            raise refiller.failure
        state.engine.need(count)
        refiller.kick()
        waiting_for = refiller.round
        deadline = self.clock.monotonic() + self.settings.timeout
        while True:
            if not await refiller.wait(deadline):
                raise DispenserUnavailable(
                    "timeout", f"no IDs of {state.name!r} within {self.settings.timeout:g} s"
                ) from None
            if refiller.refused is not None and refiller.round == waiting_for:
                raise refiller.refused
            if state.held() >= count or refiller.task is None:
                return
            failure = refiller.failure
            if isinstance(failure, IdRequestError) and failure.code != "timeout":
                raise failure

    def _start_refill(self, state: _Tag) -> None:
        if not self._closed:
            state.refiller.kick()

    async def _request_direct(self, kind: Kind, tag: str, count: int) -> list[Range]:
        """One request, not buffered (snowflake IDs); a lost reply is asked again with the same ``request_id``."""
        _check_tag(tag)
        request = _ranges(count)
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


def _ranges(count: int) -> IdRequest:
    """A plain tag's refill: ``count`` IDs as ranges, with a ``request_id`` of its own."""
    return IdRequest(count=count, request_id=uuid.uuid4().hex, format="ranges")


def _check_tag(tag: str) -> None:
    """Refuse a tag name no worker would accept, as they would (``invalid_tag``), before any request.

    A name that is no NATS subject token ("bad tag!") would otherwise fail in the transport, look like an
    outage, and be retried in the background for ever.
    """
    try:
        validate_tag(tag)
    except InvalidTag as exc:
        raise IdRequestError(InvalidTag.code, str(exc), False) from None
