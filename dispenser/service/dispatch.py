"""Turns requests into answers, whatever broker carried them.

A broker adapter decodes a request once (:meth:`Dispatcher.decode` for a NATS body; Kafka's adapter
decodes its own :class:`~dispenser.messages.KafkaIdRequest`, an :class:`IdRequest` too) and gets one
:class:`Answer` back. The common case, a known tag with IDs buffered, is answered by
:meth:`Dispatcher.answer_now` without awaiting anything; everything else goes through
:meth:`Dispatcher.answer`. Every failure, expected or not, becomes an error answer here, and nowhere else.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dispenser.core.errors import (
    CountTooLarge,
    DispenserError,
    InternalError,
    InvalidCount,
    MessageTooLarge,
    StoreUnavailable,
    Unavailable,
)
from dispenser.core.ids import Range
from dispenser.core.permute import Permutation
from dispenser.core.sqids_form import MAX_SQIDS, sqids_of
from dispenser.core.tags import validate_tag
from dispenser.messages import (
    ErrorBody,
    IdRequest,
    JsonReplies,
    Kind,
    Reply,
    decode_request,
    encode_reply,
)
from dispenser.ports import Clock, IdSource, RangesBatch, ReplayStore, Settled
from dispenser.service.answering import Answer, Answerer
from dispenser.service.dedup import ReplayCache, reused_request_id
from dispenser.service.permuted import PermutedBatch, PermutedMarks
from dispenser.service.timing import Deadlines

__all__ = ["LATENCY_BUCKETS", "MAX_PERMUTED_IDS", "Answer", "Answerer", "Dispatcher", "Limits"]

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (seconds) of the request latency histogram. Requests answered inline count in the first:
they never wait for anything (measured: ~10 µs of the worker's time), and timing each would cost the hot
path more than the answer itself."""

_UNSETTLED_LOG_INTERVAL = 10.0
"""Seconds between warnings that the replay store is down (one per outage-ish, not one per request)."""

MAX_PERMUTED_IDS = 10_000
"""The most IDs of a permuted tag one request gets, in either format (or ``limits.max_ids`` if lower). They are
enciphered in the event loop, together (~0.5-1 µs an ID from 1,000 on, on the development machine), so 10,000
hold the worker's other requests for ~10 ms; the reply's size binds first: 10,000 IDs as ``[id, id]`` ranges
are ~420 KB of JSON, under NATS's and Kafka's default 1 MB message (docs/permuted.md)."""

_REMEMBERED = 1024
"""How many request bodies and tag names the hot path remembers as valid (cleared when full)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for."""

    max_ids: int = 10_000
    max_ranges: int = 1_000_000
    max_body_bytes: int = 4096
    deadline: float = 2.0
    """Seconds a request may wait (for a segment, the next millisecond, a recorded mark) before it fails."""


def _no_answer_in_time() -> StoreUnavailable:
    return StoreUnavailable("no answer before the request's deadline")


class Dispatcher:
    """Request in, reply out, for one kind of generator."""

    def __init__(
        self,
        source: IdSource,
        clock: Clock,
        limits: Limits,
        dedup_ttl: float = 60.0,
        *,
        kind: Kind = "segment",
        replay_store: ReplayStore | None = None,
        refuse_unsettled: bool = True,
        permuted: Mapping[str, Permutation] | None = None,
        marks: PermutedMarks | None = None,
    ) -> None:
        """Answer requests from ``source``.

        Args:
            source: the generator.
            clock: the clock timing requests and expiring remembered answers.
            limits: what one request may ask for.
            dedup_ttl: seconds an answer to a ``request_id`` is remembered.
            kind: the generator's kind, part of the fleet-wide key of a ``request_id``.
            replay_store: where the fleet records answers to requests with a ``request_id``, so that a
                retry on another worker gets the same IDs; ``None``: this worker's memory only.
            refuse_unsettled: answer ``unavailable`` rather than IDs when ``replay_store`` cannot record
                the answer before the request's deadline (``limits.dedup_unsettled = "refuse"``, the
                default); ``False``: answer from the buffer, idempotent on this worker only (``"answer"``).
            permuted: the permuted tags' permutations (docs/permuted.md): their IDs are answered permuted,
                one by one (at most :data:`MAX_PERMUTED_IDS` in either format), never from the remembered fast
                path.
            marks: the tags the store marks permuted: one without a key here is refused (``unavailable``),
                never answered plain.
        """
        self._source = source
        # A source that hands out a single range without building a batch (the segment allocator's
        # try_run): reply_now's hot path; any other source answers from its batch.
        # (None: a source without one, the snowflake generator: a test per request, not a call.)
        self._try_run: Callable[[str, int], Range | None] | None = getattr(source, "try_run", None)
        self._clock = clock
        self.limits = limits
        self.kind = kind
        self._replay_store = replay_store
        self.refuse_unsettled = refuse_unsettled
        """Whether an answer the replay store did not record in time is refused (see ``__init__``)."""
        self._deadlines = Deadlines(clock)
        self._replays: ReplayCache[RangesBatch] = ReplayCache(dedup_ttl, clock.monotonic)
        self._bodies: dict[bytes, IdRequest] = {}
        self._tags: set[str] = set()
        """Plain tags seen before (a permuted tag is never here: the fast path of :meth:`reply_now` skips it)."""
        self._permuted: dict[str, Permutation] = dict(permuted or {})
        self._marked: set[str] = set() if marks is None else marks.tags  # the same set, kept current
        if marks is not None:
            marks.on_marked.append(self._tags.discard)  # a tag remembered as plain, then marked
        self._json = JsonReplies()
        self.inline = 0
        """Requests answered without waiting."""
        self.waited = [0] * (len(LATENCY_BUCKETS) + 1)
        """Requests that waited, by latency bucket (the last one: over the largest bound)."""
        self.waited_seconds = 0.0
        self.errors: dict[str, int] = {}
        """Error replies by code."""
        self.replays_unsettled = 0
        """Answers to a ``request_id`` given without the replay store (it was down): this worker's only."""
        self._unsettled_logged_at = -math.inf

    def decode(self, tag: str, body: bytes, msgpack: bool = False) -> IdRequest:
        """The request in ``body`` for ``tag``, checked against the limits.

        Clients send the same few bodies over and over (``{"count": 100}``): each valid JSON body and each
        valid tag is remembered, so the hot path neither decodes nor matches a regex again.

        Raises:
            BadRequest: an invalid tag, a body over the size limit, not JSON (msgpack), a wrong field, or
                a count out of bounds (checked in that order).
        """
        request = self._bodies.get(body) if not msgpack else None
        if request is not None and tag in self._tags:
            return request
        self._check_tag(tag)
        self.check_size(body)
        request = decode_request(body, msgpack)
        self._check_count(request, tag)
        # Not a body with a request_id (not sent again soon), nor one in the sqids format: reply_now's fast path
        # answers numbers only.
        if not msgpack and request.request_id is None and request.format != "sqids":
            if len(self._bodies) >= _REMEMBERED:
                self._bodies.clear()
            self._bodies[body] = request
        return request

    def reply_now(self, tag: str, body: bytes) -> bytes | Answer | IdRequest | None:
        """:meth:`decode` and :meth:`answer_now` in one call, for a JSON body and a tag seen before.

        The hot path of a broker that hands bodies over: no :class:`Answer` for a success, no second
        check of a count checked when the body was remembered (the limits do not change), a call or two
        fewer per request.

        Returns:
            The reply body (the IDs were at hand); an error :class:`Answer`; the request, decoded, when it
            must wait (await :meth:`answer`); ``None`` when the body or the tag is not remembered (call
            :meth:`decode`, then :meth:`answer_now`).
        """
        request = self._bodies.get(body)
        if request is None or tag not in self._tags:
            return None
        try:
            try_run = self._try_run
            run = None if try_run is None else try_run(tag, request.count)  # nearly every one: no batch built
            batch = None if run is not None else self._source.try_take(tag, request.count)
        except DispenserError as exc:
            return self.error(tag, exc)
        except Exception as exc:
            return self._internal(tag, exc, False)
        if run is None:
            if batch is None:
                return request
            if len(batch.ranges) > 1:
                self.inline += 1
                return self._reply(tag, request, batch, False)
            run = batch.ranges[0]
        self.inline += 1
        first, last = run  # remembered bodies carry no request_id
        if request.format == "ranges":
            return self._json.one_range(tag, first, last)
        return self._json.ids(tag, first, last)

    def answer_now(
        self, tag: str, request: IdRequest, msgpack: bool = False, *, encode: bool = True
    ) -> Answer | None:
        """Answer without waiting if possible.

        The tag and the request's limits are checked here too (a broker may decode its own request type,
        as Kafka does), cheaply for a tag seen before. ``encode=False``: the IDs in :attr:`Answer.ranges`
        only, no reply body (an error answer has its body all the same).

        Returns:
            The answer (IDs or an error), or ``None``: call :meth:`answer`, which may wait (IDs not at hand,
            or a ``request_id`` to record).
        """
        if request.request_id is not None:
            return None
        try:
            if tag not in self._tags:
                self._check_tag(tag)
            self._check_count(request, tag)
            batch = self._source.try_take(tag, request.count)
            if batch is not None and (self._permuted or self._marked):  # one falsy test without them
                batch = self._permute(tag, batch)
        except DispenserError as exc:
            return self.error(tag, exc, msgpack)
        except Exception as exc:
            return self._internal(tag, exc, msgpack)
        if batch is None:
            return None
        self.inline += 1
        return Answer(self._reply(tag, request, batch, msgpack) if encode else b"", ranges=batch.ranges)

    async def answer(
        self, tag: str, request: IdRequest, msgpack: bool = False, *, encode: bool = True
    ) -> Answer:
        """Answer, waiting for a segment or the clock where needed; never raises.

        The tag and the request's limits are checked here, and ``encode`` means, as for :meth:`answer_now`.
        """
        started = self._clock.monotonic()
        try:
            self._check_tag(tag)
            self._check_count(request, tag)
            deadline = started + self.limits.deadline
            if request.request_id is None:
                batch = await self._source.take(tag, request.count, deadline)
                if self._permuted or self._marked:
                    batch = self._permute(tag, batch)
            else:
                batch = await self._replayed(tag, request, deadline)
        except DispenserError as exc:
            return self.error(tag, exc, msgpack)
        except Exception as exc:
            return self._internal(tag, exc, msgpack)
        finally:
            self._observe(self._clock.monotonic() - started)
        return Answer(self._reply(tag, request, batch, msgpack) if encode else b"", ranges=batch.ranges)

    async def _replayed(self, tag: str, request: IdRequest, deadline: float) -> RangesBatch:
        """IDs for a request with a ``request_id``: ours, or those another worker already answered with.

        This worker's :class:`ReplayCache` in front makes concurrent copies here share one draw; the
        store settles the race between workers (the first recorded answer wins, ours become gaps). One
        coroutine, and the store's own future awaited directly, on every such request's path.
        """
        assert request.request_id is not None
        key = (tag, request.request_id)
        held = self._replays.held(key, (request.count, request.format))
        if held is not None:
            return await held if isinstance(held, asyncio.Future) else held
        try:
            batch = await self._take_once(tag, request, deadline)
        except BaseException as exc:
            self._replays.fail(key, exc)
            raise
        self._replays.remember(key, batch)
        return batch

    async def _take_once(self, tag: str, request: IdRequest, deadline: float) -> RangesBatch:
        """Draw the IDs and settle them with the fleet's store (see :meth:`_replayed`)."""
        batch = self._source.try_take(tag, request.count)
        if batch is None:
            batch = await self._source.take(tag, request.count, deadline)
        if self._permuted or self._marked:  # the permuted IDs are the answer a retry gets
            batch = self._permute(tag, batch)
        store = self._replay_store
        if store is None:
            return batch
        assert request.request_id is not None
        settling = store.settle(
            (self.kind, tag, request.request_id),
            request.count,
            request.format,
            tuple(batch.ranges),
            self._replays.ttl,
        )
        settled: Settled
        try:
            # Within the request's deadline: the IDs are in hand, and a store that is failing over (or
            # waiting for a synchronous standby) must not make a request wait longer than a fetch would.
            if isinstance(settling, asyncio.Future) and not isinstance(settling, asyncio.Task):
                # The PostgreSQL store's own future: failed at the deadline by the dispatcher's shared
                # timer, no task or waiter per request (a request cancelled meanwhile cancels it).
                self._deadlines.expire(settling, deadline, _no_answer_in_time)
                settled = await settling
            else:
                task = asyncio.ensure_future(settling)
                try:
                    if not await self._deadlines.wait(task, deadline):
                        raise _no_answer_in_time()
                finally:
                    if not task.done():
                        task.cancel()
                settled = task.result()
        except StoreUnavailable as exc:
            if self.refuse_unsettled:
                # Exact or nothing: the IDs drawn become a gap; the client retries with the same request_id.
                raise Unavailable(
                    f"the answer to request_id {request.request_id!r} could not be recorded ({exc.message}); "
                    "retry with the same request_id",
                    logged=f"the answer to request_id {request.request_id!r} could not be recorded ({exc})",
                ) from None
            # The IDs are in hand and unique whatever happens; failing the request would make every
            # client that sends request_ids (as retrying clients should) lose the double buffer's
            # runway with PostgreSQL. So answer, idempotent on this worker only, and say so.
            self.replays_unsettled += 1
            now = self._clock.monotonic()
            if now - self._unsettled_logged_at >= _UNSETTLED_LOG_INTERVAL:
                self._unsettled_logged_at = now
                log.warning(
                    "answering request_id requests without the fleet-wide replay store (%s): a retry on "
                    "another worker would get other IDs until it is back (%d so far)",
                    exc,  # str(): with where the store is, which the reply's message leaves out
                    self.replays_unsettled,
                )
            return batch
        if (settled.count, settled.format) != (request.count, request.format):
            raise reused_request_id(request.request_id, settled.count, settled.format)
        return settled

    def _observe(self, seconds: float) -> None:
        self.waited_seconds += seconds
        self.waited[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def error(self, tag: str, exc: DispenserError, msgpack: bool = False) -> Answer:
        """The error reply for ``exc``."""
        self.errors[exc.code] = self.errors.get(exc.code, 0) + 1
        body = ErrorBody(code=exc.code, message=exc.message, retryable=exc.retryable)
        return Answer(encode_reply(Reply(tag=tag, error=body), msgpack), exc)

    def _internal(self, tag: str, exc: Exception, msgpack: bool) -> Answer:
        log.exception("unexpected failure answering a request for tag %r", tag, exc_info=exc)
        return self.error(
            tag, InternalError(f"internal error ({type(exc).__name__}); see the worker's log"), msgpack
        )

    def check_size(self, body: bytes) -> None:
        """Raise :class:`MessageTooLarge` if ``body`` is over the limit (before anyone decodes it)."""
        if len(body) > self.limits.max_body_bytes:
            raise MessageTooLarge(len(body), self.limits.max_body_bytes)

    def _check_tag(self, tag: str) -> None:
        # Checked before: no regex (~1 µs) again, twice per request that waits or carries a request_id.
        if tag in self._tags:
            return
        validate_tag(tag)
        if tag in self._permuted or tag in self._marked:
            return
        if len(self._tags) >= _REMEMBERED:
            self._tags.clear()
        self._tags.add(tag)

    def _check_count(self, request: IdRequest, tag: str) -> None:
        count = request.count
        if count < 1:
            raise InvalidCount(count)
        limits = self.limits
        if tag in self._permuted:  # enciphered in the event loop: see MAX_PERMUTED_IDS
            limit = min(limits.max_ids, MAX_PERMUTED_IDS)
        else:
            limit = limits.max_ranges if request.format == "ranges" else limits.max_ids
        if request.format == "sqids":  # each string ~11 µs in the event loop: see MAX_SQIDS
            limit = min(limit, MAX_SQIDS)
        if count > limit:
            raise CountTooLarge(count, limit, request.format)

    def _permute(self, tag: str, batch: RangesBatch) -> RangesBatch:
        """A permuted tag's IDs for the counters of ``batch``, each a range of its own; a plain tag's as they are.

        Raises:
            Unavailable: the store marks the tag permuted and this worker has no key for it (the counters
                drawn are a gap).
        """
        permutation = self._permuted.get(tag)
        if permutation is not None:
            return PermutedBatch.of(permutation.ids(batch.ranges))
        if tag in self._marked:
            raise Unavailable(
                f"tag {tag!r} is permuted and this worker has no key file for it (segment.permute_keys_dir)"
            )
        return batch

    def _reply(self, tag: str, request: IdRequest, batch: RangesBatch, msgpack: bool) -> bytes:
        ranges = batch.ranges
        # A permuted tag's reply says so (Reply.permuted): a buffered client keeps its IDs as a list.
        permuted = tag in self._permuted
        if request.format == "sqids":  # each ID as a string (core/sqids_form.py)
            reply = Reply(tag=tag, sqids=sqids_of(ranges), request_id=request.request_id, permuted=permuted)
            return encode_reply(reply, msgpack)
        if len(ranges) == 1 and not msgpack and request.request_id is None and not permuted:  # the hot path's
            first, last = ranges[0]
            if request.format == "ranges":
                return self._json.one_range(tag, first, last)
            return self._json.ids(tag, first, last)
        rid = request.request_id
        if request.format == "ranges":
            reply = Reply(tag=tag, ranges=list(ranges), request_id=rid, permuted=permuted)
        elif len(ranges) == 1:
            first, last = ranges[0]
            reply = Reply(tag=tag, ids=list(range(first, last + 1)), request_id=rid, permuted=permuted)
        else:
            ids = (
                batch.ids  # as enciphered, not flattened back from their ranges
                if isinstance(batch, PermutedBatch)
                else [i for first, last in ranges for i in range(first, last + 1)]
            )
            reply = Reply(tag=tag, ids=ids, request_id=rid, permuted=permuted)
        return encode_reply(reply, msgpack)
