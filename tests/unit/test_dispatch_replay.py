"""Fleet-wide request_id: two dispatchers (two workers) over one replay store give one answer per key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from dispenser.core.errors import StoreUnavailable
from dispenser.messages import Kind, Reply, decode_request
from dispenser.ports import Settled, SystemClock
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemoryReplayStore, MemorySegmentStore


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[list[Dispatcher], MemoryReplayStore]]:
    """Two workers drawing disjoint segments of one tag from one store, sharing one replay store."""
    segments = MemorySegmentStore()
    await segments.add_tag("order", 100)
    replays = MemoryReplayStore(time.monotonic)
    allocators = [SegmentAllocator(segments, SystemClock(), AllocatorSettings()) for _ in range(2)]
    for allocator in allocators:
        await allocator.refresh()
    dispatchers = [
        Dispatcher(allocator, SystemClock(), Limits(), kind="segment", replay_store=replays)
        for allocator in allocators
    ]
    yield dispatchers, replays
    for allocator in allocators:
        await allocator.close()


def reply_of(body: bytes) -> Reply:
    return msgspec.json.decode(body, type=Reply)


async def test_eight_racing_copies_on_two_workers_get_one_answer(
    fleet: tuple[list[Dispatcher], MemoryReplayStore],
) -> None:
    """The same request_id sent 8 times at once, 4 to each worker: 8 identical replies."""
    dispatchers, _ = fleet
    body = b'{"count": 5, "request_id": "pay-42"}'
    answers = await asyncio.gather(
        *(dispatchers[n % 2].answer("order", decode_request(body)) for n in range(8))
    )
    assert all(answer.error is None for answer in answers)
    assert len({answer.body for answer in answers}) == 1
    assert len(reply_of(answers[0].body).ids or []) == 5


async def test_a_retry_on_the_other_worker_later_gets_the_same_ids(
    fleet: tuple[list[Dispatcher], MemoryReplayStore],
) -> None:
    """First answered by worker 0, retried on worker 1: the same IDs; a new request_id: new ones."""
    dispatchers, _ = fleet
    first = await dispatchers[0].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    retry = await dispatchers[1].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    other = await dispatchers[1].answer("order", decode_request(b'{"count": 3, "request_id": "r-2"}'))
    assert retry.body == first.body
    assert set(reply_of(other.body).ids or []).isdisjoint(reply_of(first.body).ids or [])


async def test_a_changed_retry_on_the_other_worker_is_refused(
    fleet: tuple[list[Dispatcher], MemoryReplayStore],
) -> None:
    """The same request_id with another count, on another worker: an invalid error, not other IDs."""
    dispatchers, _ = fleet
    await dispatchers[0].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    changed = await dispatchers[1].answer("order", decode_request(b'{"count": 4, "request_id": "r-1"}'))
    assert changed.error is not None
    assert changed.error.code == "invalid"
    assert "count 3" in changed.error.message


async def test_kinds_do_not_share_request_ids() -> None:
    """The key includes the generator's kind.

    The same tag and request_id on the segment and the snowflake dispatcher (one store) get each their own
    generator's IDs, not the other's answer.
    """
    segments = MemorySegmentStore()
    await segments.add_tag("order", 100)
    snowflake_like = MemorySegmentStore()  # another generator: its IDs start elsewhere
    await snowflake_like.add_tag("order", 100, start=1_000_000)
    replays = MemoryReplayStore(time.monotonic)
    allocators = [
        SegmentAllocator(store, SystemClock(), AllocatorSettings()) for store in (segments, snowflake_like)
    ]
    dispatchers = []
    kinds: tuple[Kind, Kind] = ("segment", "snowflake")
    for allocator, kind in zip(allocators, kinds, strict=True):
        await allocator.refresh()
        dispatchers.append(Dispatcher(allocator, SystemClock(), Limits(), kind=kind, replay_store=replays))
    try:
        body = b'{"count": 3, "request_id": "r-1"}'
        segment_ids = reply_of((await dispatchers[0].answer("order", decode_request(body))).body).ids
        snowflake_ids = reply_of((await dispatchers[1].answer("order", decode_request(body))).body).ids
        assert segment_ids == [1, 2, 3]
        assert snowflake_ids == [1_000_000, 1_000_001, 1_000_002]
        assert len(replays) == 2
    finally:
        for allocator in allocators:
            await allocator.close()


async def test_with_the_store_down_and_answer_unsettled_requests_are_answered_and_counted(
    fleet: tuple[list[Dispatcher], MemoryReplayStore],
) -> None:
    """``limits.dedup_unsettled = answer``: the store down, request_ids still get (unique) IDs, counted."""
    dispatchers, replays = fleet
    for dispatcher in dispatchers:
        dispatcher.refuse_unsettled = False
    replays.fail_with = StoreUnavailable("down for the test")
    first = await dispatchers[0].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    again = await dispatchers[0].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    assert first.error is None
    assert again.body == first.body  # still idempotent on this worker
    assert dispatchers[0].replays_unsettled == 1
    replays.fail_with = None
    other = await dispatchers[1].answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
    assert set(reply_of(other.body).ids or []).isdisjoint(reply_of(first.body).ids or [])


async def test_with_the_store_down_only_recorded_answers_are_given() -> None:
    """By default (``limits.dedup_unsettled = refuse``) no answer is given that the fleet has not recorded."""
    segments = MemorySegmentStore()
    await segments.add_tag("order", 100)
    replays = MemoryReplayStore(time.monotonic)
    allocators = [SegmentAllocator(segments, SystemClock(), AllocatorSettings()) for _ in range(2)]
    try:
        for allocator in allocators:
            await allocator.refresh()
        workers = [
            Dispatcher(a, SystemClock(), Limits(), kind="segment", replay_store=replays) for a in allocators
        ]
        body = b'{"count": 3, "request_id": "r-1"}'
        replays.fail_with = StoreUnavailable("down for the test")
        refused = await workers[0].answer("order", decode_request(body))
        assert refused.error is not None
        assert refused.error.code == "unavailable"
        assert refused.error.retryable
        assert "retry with the same request_id" in refused.error.message
        assert workers[0].replays_unsettled == 0
        replays.fail_with = None
        first = await workers[0].answer("order", decode_request(body))  # the retry, store back
        again = await workers[1].answer("order", decode_request(body))  # and once more, elsewhere
        assert first.error is None
        assert again.body == first.body
    finally:
        for allocator in allocators:
            await allocator.close()


async def test_requests_without_request_id_never_touch_the_store(
    fleet: tuple[list[Dispatcher], MemoryReplayStore],
) -> None:
    """The common path is untouched: no request_id, no record (and a dead store changes nothing)."""
    dispatchers, replays = fleet
    replays.fail_with = StoreUnavailable("down for the test")
    for dispatcher in dispatchers:
        answer = await dispatcher.answer("order", decode_request(b'{"count": 2}'))
        assert answer.error is None
    assert len(replays) == 0


class _HangingReplayStore(MemoryReplayStore):
    """A replay store that never answers (a primary failing over, a commit waiting for a standby)."""

    async def settle(self, *args: object, **kwargs: object) -> Settled:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def hanging_dispatcher(
    clock: ManualClock, *, refuse_unsettled: bool
) -> tuple[Dispatcher, SegmentAllocator]:
    """A dispatcher (2 s deadline) whose replay store never answers."""
    segments = MemorySegmentStore()
    await segments.add_tag("order", 100)
    allocator = SegmentAllocator(segments, clock, AllocatorSettings())
    await allocator.refresh()
    dispatcher = Dispatcher(
        allocator,
        clock,
        Limits(deadline=2.0),
        kind="segment",
        replay_store=_HangingReplayStore(clock.monotonic),
        refuse_unsettled=refuse_unsettled,
    )
    return dispatcher, allocator


@pytest.mark.parametrize("refuse_unsettled", [True, False])
async def test_a_hanging_store_delays_a_request_no_longer_than_its_deadline(refuse_unsettled: bool) -> None:
    """The IDs are in hand: a replay store that hangs costs the request its deadline at most, not more."""
    clock = ManualClock()
    dispatcher, allocator = await hanging_dispatcher(clock, refuse_unsettled=refuse_unsettled)
    try:
        answering = asyncio.create_task(
            dispatcher.answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
        )
        await settle()
        assert not answering.done()  # waiting on the store, within its deadline
        await clock.advance(1.999)
        assert not answering.done()
        await clock.advance(0.001)
        answer = await asyncio.wait_for(answering, 5)
        if refuse_unsettled:
            assert answer.error is not None
            assert answer.error.code == "unavailable"
            assert dispatcher.replays_unsettled == 0
        else:
            assert answer.error is None
            assert reply_of(answer.body).ids == [1, 2, 3]
            assert dispatcher.replays_unsettled == 1
    finally:
        await allocator.close()


async def test_by_default_an_answer_the_store_did_not_record_in_time_is_refused() -> None:
    """The default keeps the README's promise: a store that hangs past the deadline gets ``unavailable``.

    (Before, the default answered the IDs unrecorded, and a retry on another worker got other IDs.)
    """
    clock = ManualClock()
    segments = MemorySegmentStore()
    await segments.add_tag("order", 100)
    allocator = SegmentAllocator(segments, clock, AllocatorSettings())
    await allocator.refresh()
    dispatcher = Dispatcher(
        allocator,
        clock,
        Limits(deadline=2.0),
        kind="segment",
        replay_store=_HangingReplayStore(clock.monotonic),
    )
    try:
        answering = asyncio.create_task(
            dispatcher.answer("order", decode_request(b'{"count": 3, "request_id": "r-1"}'))
        )
        await clock.advance(2.0)
        answer = await asyncio.wait_for(answering, 5)
        assert answer.error is not None, reply_of(answer.body)
        assert (answer.error.code, answer.error.retryable) == ("unavailable", True)
        assert "retry with the same request_id" in answer.error.message
    finally:
        await allocator.close()


async def test_many_requests_waiting_on_a_hanging_store_each_fail_at_their_own_deadline() -> None:
    """Requests that arrived at different times over one hanging store are refused each at its deadline."""
    clock = ManualClock()
    dispatcher, allocator = await hanging_dispatcher(clock, refuse_unsettled=True)
    try:
        early = [
            asyncio.create_task(
                dispatcher.answer("order", decode_request(f'{{"request_id": "e-{n}"}}'.encode()))
            )
            for n in range(3)
        ]
        await clock.advance(0.5)
        late = [
            asyncio.create_task(
                dispatcher.answer("order", decode_request(f'{{"request_id": "l-{n}"}}'.encode()))
            )
            for n in range(3)
        ]
        await clock.advance(1.5)  # the early ones' deadline
        assert all(task.done() for task in early)
        assert not any(task.done() for task in late)
        await clock.advance(0.5)
        assert all(task.done() for task in late)
        for task in early + late:
            error = task.result().error
            assert error is not None
            assert error.code == "unavailable"
    finally:
        await allocator.close()
