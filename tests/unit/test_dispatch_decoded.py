"""The dispatcher answering requests an adapter decoded itself (Kafka's carry tag and kind in the body)."""

from __future__ import annotations

import msgspec

from dispenser.messages import IdRequest, Reply
from dispenser.ports import SystemClock
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing.fakes import MemorySegmentStore


async def dispatcher_with(tag: str = "order", step: int = 10) -> tuple[Dispatcher, SegmentAllocator]:
    store = MemorySegmentStore()
    await store.add_tag(tag, step)
    allocator = SegmentAllocator(store, SystemClock(), AllocatorSettings())
    await allocator.refresh()
    return Dispatcher(allocator, SystemClock(), Limits(max_ids=100, max_ranges=1000)), allocator


def reply_of(body: bytes) -> Reply:
    return msgspec.json.decode(body, type=Reply)


async def test_decoded_request_waits_for_the_first_segment_then_answers_inline() -> None:
    """The first request waits for a segment; once IDs are buffered the same request is answered inline."""
    dispatcher, allocator = await dispatcher_with()
    try:
        assert dispatcher.answer_now("order", IdRequest(count=3)) is None
        first = await dispatcher.answer("order", IdRequest(count=3))
        assert first.error is None
        assert reply_of(first.body).ids == [1, 2, 3]
        now = dispatcher.answer_now("order", IdRequest(count=2, format="ranges"))
        assert now is not None
        assert reply_of(now.body).ranges == [(4, 5)]
    finally:
        await allocator.close()


async def test_decoded_requests_are_checked_like_bodies() -> None:
    """Tag and count limits hold for decoded requests, inline and waiting, as error replies."""
    dispatcher, allocator = await dispatcher_with()
    try:
        cases = {
            ("bad tag", 1, "ids"): "invalid_tag",
            ("order", 0, "ids"): "invalid_count",
            ("order", 101, "ids"): "count_too_large",
            ("order", 1001, "ranges"): "count_too_large",
        }
        for (tag, count, fmt), code in cases.items():
            request = IdRequest(count=count, format=fmt)  # type: ignore[arg-type]
            now = dispatcher.answer_now(tag, request)
            assert now is not None
            assert now.error is not None
            assert now.error.code == code
            later = await dispatcher.answer(tag, request)
            assert later.error is not None
            assert later.error.code == code
        unknown = await dispatcher.answer("missing", IdRequest())
        assert unknown.error is not None
        assert unknown.error.code == "unknown_tag"
    finally:
        await allocator.close()


async def test_a_request_id_always_takes_the_replay_path() -> None:
    """With a ``request_id`` nothing is answered inline, and a retry gets the same IDs."""
    dispatcher, allocator = await dispatcher_with()
    try:
        request = IdRequest(count=4, request_id="abc")
        assert dispatcher.answer_now("order", request) is None
        first = await dispatcher.answer("order", request)
        again = await dispatcher.answer("order", request)
        assert first.body == again.body
    finally:
        await allocator.close()
