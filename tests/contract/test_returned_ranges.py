"""Unused IDs returned on a clean stop, in the SegmentStore contract (docs/segment.md), fake and PostgreSQL.

A worker returns what it was granted and never handed out; a later fetch of the tag hands it out before
new IDs, once: never twice, whoever fetches, and never after the tag was removed and added again.
"""

from __future__ import annotations

import asyncio

from dispenser.core.residue import Residue
from dispenser.core.segment import Segment
from dispenser.ports import SegmentStore


async def test_returned_ids_are_handed_out_before_new_ones_and_once(store: SegmentStore) -> None:
    """The rest of a current segment and a whole next one, returned, come back lowest first, then new IDs."""
    await store.add_tag("order", step=100)
    await store.next_segment("order")  # [1, 100]: 1-39 handed out
    await store.next_segment("order")  # [101, 200]: none handed out
    assert await store.return_unused("order", [(40, 100), (101, 200)], "worker-a") == 161
    first = await store.next_segment("order")
    assert first.segment == Segment(40, 100)
    assert first.configured_step == 100
    assert (await store.next_segment("order")).segment == Segment(101, 200)
    assert (await store.next_segment("order")).segment == Segment(201, 300)
    assert (await store.next_segment("order")).segment == Segment(301, 400)


async def test_a_fetch_takes_no_returned_range_at_or_below_the_ids_it_holds(store: SegmentStore) -> None:
    """``above`` keeps a worker's IDs increasing: a range below its newest is left for another worker."""
    await store.add_tag("order", step=100)
    await store.next_segment("order")  # [1, 100]
    await store.next_segment("order")  # [101, 200], held by a worker that goes on
    assert await store.return_unused("order", [(50, 100)], "worker-a") == 51
    assert (await store.next_segment("order", above=200)).segment == Segment(201, 300)
    assert (await store.next_segment("order", above=49)).segment == Segment(50, 100)


async def test_two_fetchers_never_take_the_same_returned_range(store: SegmentStore) -> None:
    """Eight fetches at once over one returned range: exactly one gets it, and every segment is disjoint."""
    await store.add_tag("order", step=100)
    await store.next_segment("order")
    assert await store.return_unused("order", [(1, 100)], "worker-a") == 100
    allocations = await asyncio.gather(*(store.next_segment("order") for _ in range(8)))
    segments = sorted((a.segment.first, a.segment.last) for a in allocations)
    assert segments[0] == (1, 100)
    assert segments[1:] == [(101 + 100 * i, 200 + 100 * i) for i in range(7)]


async def test_a_removed_and_added_tag_drops_what_was_returned(store: SegmentStore) -> None:
    """Returned ranges go with the tag: never back after a remove and a re-add; a late return is refused."""
    await store.add_tag("order", step=100)
    await store.next_segment("order")
    await store.next_segment("order")
    assert await store.return_unused("order", [(101, 200)], "worker-a") == 100
    await store.remove_tag("order")
    await store.add_tag("order", step=100, start=201)
    assert (await store.next_segment("order")).segment == Segment(201, 300)
    # A worker that still held [1, 100] of the removed tag stops only now.
    assert await store.return_unused("order", [(50, 100)], "worker-b") == 0
    assert (await store.next_segment("order")).segment == Segment(301, 400)


async def test_ids_never_granted_are_not_taken_back(store: SegmentStore) -> None:
    """A range at or above the tag's high water was never granted: returning it would hand it out twice."""
    await store.add_tag("order", step=100)
    await store.next_segment("order")
    assert await store.return_unused("order", [(90, 150)], "worker-a") == 0
    assert await store.return_unused("gone", [(1, 10)], "worker-a") == 0
    assert (await store.next_segment("order")).segment == Segment(101, 200)


async def test_a_returned_range_keeps_its_tags_class(store: SegmentStore) -> None:
    """A tag of a residue class gets its returned IDs back as the same class's ordinals."""
    residue = Residue(4, 1)
    await store.add_tag("order", step=10, residue=residue)
    granted = await store.next_segment("order")
    ids = residue.ids((granted.segment.first, granted.segment.last))
    rest = (ids.first + 4 * 3, ids.last)  # three of its ten IDs handed out
    assert await store.return_unused("order", [rest], "worker-a") == 7
    again = await store.next_segment("order")
    assert again.residue == residue
    assert residue.ids((again.segment.first, again.segment.last)) == residue.ids(
        (residue.ordinal(rest[0]), residue.ordinal(rest[1]))
    )
    # A range of another class is not one of its grants.
    assert await store.return_unused("order", [(ids.first + 1, ids.first + 1)], "worker-a") == 0


async def test_returned_ranges_are_taken_oldest_first_only(store: SegmentStore) -> None:
    """A worker above the oldest returned range takes no newer one past it: both wait, in order, for another.

    So every range at or below a ``seq`` some worker took has been taken: one a restore brings back is known.
    Before, a live worker took the newer range, and its remembered ``seq`` then dropped the older one: lost.
    """
    await store.add_tag("order", step=100)
    for _ in range(3):
        await store.next_segment("order")  # [1, 100] and [201, 300] to a stopping worker, [101, 200] live
    assert await store.return_unused("order", [(1, 100)], "worker-a") == 100
    assert await store.return_unused("order", [(201, 300)], "worker-b") == 100
    assert (await store.next_segment("order", above=200)).segment == Segment(301, 400)
    assert (await store.next_segment("order")).segment == Segment(1, 100)
    assert (await store.next_segment("order", above=100)).segment == Segment(201, 300)
