"""The SegmentStore contract, written once and run against the in-memory fake and the Postgres adapter."""

from __future__ import annotations

import asyncio
import itertools
from datetime import datetime

import pytest

from dispenser.core.errors import (
    BadRequest,
    InvalidTag,
    StoreUnavailable,
    TagExhausted,
    TagExists,
    TagStartTooLow,
    UnknownTag,
)
from dispenser.core.segment import Segment
from dispenser.ports import SegmentStore

MAX_ID = 2**63 - 1


async def test_first_segment_starts_at_start(store: SegmentStore) -> None:
    """A new tag's first segment is [start, start + step - 1], reported with the configured step."""
    await store.add_tag("order", step=1000, start=5000)
    allocation = await store.next_segment("order")
    assert allocation.segment == Segment(5000, 5999)
    assert allocation.configured_step == 1000


async def test_default_start_is_one(store: SegmentStore) -> None:
    """Without a start, the first ID is 1, like Leaf's table default ``max_id = 1``."""
    await store.add_tag("order", step=10)
    assert (await store.next_segment("order")).segment == Segment(1, 10)


async def test_consecutive_segments_are_adjacent(store: SegmentStore) -> None:
    """Each segment starts right after the previous one ends."""
    await store.add_tag("order", step=100)
    segments = [(await store.next_segment("order")).segment for _ in range(5)]
    assert segments == [Segment(1 + 100 * i, 100 * (i + 1)) for i in range(5)]


async def test_explicit_step_is_honoured(store: SegmentStore) -> None:
    """An explicit step sizes that segment only; the configured step is reported and kept."""
    await store.add_tag("order", step=100)
    big = await store.next_segment("order", step=2500)
    assert big.segment == Segment(1, 2500)
    assert big.configured_step == 100
    assert (await store.next_segment("order")).segment == Segment(2501, 2600)


async def test_set_step_takes_effect_at_next_segment(store: SegmentStore) -> None:
    """After set_step, the next default-sized segment has the new size; earlier ones are untouched."""
    await store.add_tag("order", step=100)
    first = await store.next_segment("order")
    info = await store.set_step("order", 30)
    assert (info.tag, info.step, info.max_id) == ("order", 30, 101)
    second = await store.next_segment("order")
    assert first.segment == Segment(1, 100)
    assert second.segment == Segment(101, 130)
    assert second.configured_step == 30


async def test_unknown_tag(store: SegmentStore) -> None:
    """next_segment, set_step and remove_tag on a tag that was never added raise UnknownTag."""
    with pytest.raises(UnknownTag) as info:
        await store.next_segment("nope")
    assert info.value.tag == "nope"
    with pytest.raises(UnknownTag):
        await store.set_step("nope", 10)
    with pytest.raises(UnknownTag):
        await store.remove_tag("nope")


async def test_add_existing_tag(store: SegmentStore) -> None:
    """Adding a tag twice raises TagExists and leaves the first row as it was."""
    await store.add_tag("order", step=100, description="orders")
    await store.next_segment("order")
    with pytest.raises(TagExists):
        await store.add_tag("order", step=5)
    [info] = await store.list_tags()
    assert (info.max_id, info.step, info.description) == (101, 100, "orders")


async def test_a_removed_tag_never_comes_back_below_its_high_water(store: SegmentStore) -> None:
    """Removed after handing out 1-200, the tag is refused again from any start below 201; from 201 on, allowed.

    Before, `tag remove` then `tag add` started it at 1 again, silently: every ID came back.
    """
    await store.add_tag("order", step=100)
    await store.next_segment("order")
    assert (await store.next_segment("order")).segment == Segment(101, 200)
    await store.remove_tag("order")
    for start in (1, 200):
        with pytest.raises(TagStartTooLow) as info:
            await store.add_tag("order", step=100, start=start)
        assert (info.value.tag, info.value.start, info.value.high_water) == ("order", start, 201)
        assert "--start 201" in str(info.value)
    assert await store.list_tags() == []
    await store.add_tag("order", step=50, start=201)
    assert (await store.next_segment("order")).segment == Segment(201, 250)
    # Removed again: the higher of the two high waters counts.
    await store.remove_tag("order")
    with pytest.raises(TagStartTooLow) as again:
        await store.add_tag("order", step=50, start=201)
    assert again.value.high_water == 251
    # Other tags are not affected.
    await store.add_tag("user", step=10)


async def test_remove_then_next_segment(store: SegmentStore) -> None:
    """A removed tag is unknown to next_segment and gone from list_tags."""
    await store.add_tag("order", step=100)
    await store.add_tag("user", step=100)
    await store.remove_tag("order")
    with pytest.raises(UnknownTag):
        await store.next_segment("order")
    assert [t.tag for t in await store.list_tags()] == ["user"]


async def test_list_tags_ordered_with_fields(store: SegmentStore) -> None:
    """list_tags returns every row in code point order with max_id, step, description and an aware time."""
    assert await store.list_tags() == []
    await store.add_tag("order", step=100, start=7, description="orders")
    await store.add_tag("Zeta", step=5)
    await store.add_tag("alpha.v2", step=20, description="naïve—ünicode")
    await store.add_tag("a-b_c", step=1)
    await store.next_segment("order")
    tags = await store.list_tags()
    assert [(t.tag, t.max_id, t.step, t.description) for t in tags] == [
        ("Zeta", 1, 5, ""),
        ("a-b_c", 1, 1, ""),
        ("alpha.v2", 1, 20, "naïve—ünicode"),
        ("order", 107, 100, "orders"),
    ]
    for t in tags:
        assert isinstance(t.update_time, datetime)
        assert t.update_time.tzinfo is not None


async def test_add_tag_returns_its_row(store: SegmentStore) -> None:
    """add_tag returns the row it created, with max_id equal to start."""
    info = await store.add_tag("order", step=100, start=42, description="orders")
    assert (info.tag, info.max_id, info.step, info.description) == ("order", 42, 100, "orders")


async def test_concurrent_segments_are_disjoint(store: SegmentStore) -> None:
    """50 concurrent next_segment calls get 50 disjoint segments that tile the range without gaps."""
    await store.add_tag("order", step=10)
    allocations = await asyncio.gather(*(store.next_segment("order") for _ in range(50)))
    segments = sorted(a.segment.first for a in allocations)
    assert segments == list(range(1, 501, 10))
    assert all(a.segment.size == 10 for a in allocations)


async def test_concurrent_mixed_steps_are_disjoint(store: SegmentStore) -> None:
    """Concurrent calls with different explicit steps still get non-overlapping segments."""
    await store.add_tag("order", step=10)
    allocations = await asyncio.gather(*(store.next_segment("order", step=1 + i % 7) for i in range(40)))
    ranges = sorted((a.segment.first, a.segment.last) for a in allocations)
    for (_, last), (first, _) in itertools.pairwise(ranges):
        assert first == last + 1
    assert ranges[0][0] == 1


async def test_tags_are_independent(store: SegmentStore) -> None:
    """Fetching segments of one tag does not move another."""
    await store.add_tag("a", step=10)
    await store.add_tag("b", step=10)
    await store.next_segment("a")
    await store.next_segment("a")
    assert (await store.next_segment("b")).segment == Segment(1, 10)


@pytest.mark.parametrize("tag", ["", "has space", "x" * 129, "semi;colon", "ünï"])
async def test_add_invalid_tag(store: SegmentStore, tag: str) -> None:
    """add_tag refuses names outside [A-Za-z0-9_.-]{1,128} with InvalidTag."""
    with pytest.raises(InvalidTag):
        await store.add_tag(tag, step=10)
    assert await store.list_tags() == []


async def test_longest_valid_tag(store: SegmentStore) -> None:
    """A 128-character tag, the column's width, works end to end."""
    tag = "t" * 128
    await store.add_tag(tag, step=3)
    assert (await store.next_segment(tag)).segment == Segment(1, 3)


@pytest.mark.parametrize(
    ("step", "start", "description"),
    [(0, 1, ""), (-5, 1, ""), (2**31, 1, ""), (10, 0, ""), (10, -1, ""), (10, 1, "d" * 257)],
)
async def test_add_tag_rejects_bad_values(
    store: SegmentStore, step: int, start: int, description: str
) -> None:
    """add_tag refuses a step or start below 1, a step over the int column, a description over 256."""
    with pytest.raises(BadRequest):
        await store.add_tag("order", step=step, start=start, description=description)
    assert await store.list_tags() == []


async def test_bad_explicit_or_configured_step(store: SegmentStore) -> None:
    """next_segment and set_step refuse steps below 1 without moving the tag."""
    await store.add_tag("order", step=10)
    with pytest.raises(BadRequest):
        await store.next_segment("order", step=0)
    with pytest.raises(BadRequest):
        await store.set_step("order", 0)
    assert (await store.next_segment("order")).segment == Segment(1, 10)


async def test_end_of_id_space(store: SegmentStore) -> None:
    """A segment that would pass 2**63 - 1 is refused (TagExhausted, not retryable); the tag is not moved."""
    await store.add_tag("order", step=10, start=MAX_ID - 15)
    assert (await store.next_segment("order")).segment == Segment(MAX_ID - 15, MAX_ID - 6)
    with pytest.raises(TagExhausted, match="no room") as caught:
        await store.next_segment("order")
    assert caught.value.retryable is False
    assert caught.value.code == "tag_exhausted"
    # max_id may reach 2**63 - 1 itself, so the last ID ever granted is one below it.
    assert (await store.next_segment("order", step=5)).segment == Segment(MAX_ID - 5, MAX_ID - 1)


async def test_closed_store_is_unavailable(store: SegmentStore) -> None:
    """After close, calls raise StoreUnavailable; closing twice is fine."""
    await store.add_tag("order", step=10)
    await store.close()
    await store.close()
    with pytest.raises(StoreUnavailable):
        await store.next_segment("order")
