"""Permuted tags in the SegmentStore contract (docs/permuted.md), against the in-memory fake and PostgreSQL."""

from __future__ import annotations

import pytest

from dispenser.core.daily import DailyPolicy
from dispenser.core.errors import BadRequest, TagExists, UnknownTag
from dispenser.core.residue import Residue
from dispenser.core.segment import Segment
from dispenser.core.store_rules import MAX_MARKED_MAX_ID
from dispenser.ports import SegmentStore


async def test_a_permuted_tag_is_listed_as_permuted_and_counts_as_any_tag(store: SegmentStore) -> None:
    """add_tag(permuted=True) marks the tag; its segments are a plain tag's (the counters the worker permutes)."""
    info = await store.add_tag("order", 100, 5, permuted=True)
    assert info.permuted
    await store.add_tag("plain", 10)
    assert (await store.next_segment("order")).segment == Segment(5, 104)
    assert {i.tag: i.permuted for i in await store.list_tags()} == {"order": True, "plain": False}


async def test_a_strided_permuted_tag_keeps_its_class(store: SegmentStore) -> None:
    """A permuted tag of a residue class (a database per datacenter): the class and the mark together."""
    await store.add_tag("order", 10, residue=Residue(2, 1), permuted=True)
    assert [i.permuted for i in await store.list_tags()] == [True]
    allocation = await store.next_segment("order")
    assert allocation.residue == Residue(2, 1)


async def test_a_removed_permuted_tag_re_added_is_not_permuted_unless_told(store: SegmentStore) -> None:
    """The mark goes with the tag; a refused add (the tag exists) changes no mark."""
    await store.add_tag("order", 10, permuted=True)
    with pytest.raises(TagExists):
        await store.add_tag("order", 10)
    assert [i.permuted for i in await store.list_tags()] == [True]
    await store.remove_tag("order")
    await store.add_tag("order", 10, 100)
    assert [i.permuted for i in await store.list_tags()] == [False]


async def test_an_existing_tag_is_marked_and_unmarked(store: SegmentStore) -> None:
    """set_permuted marks a tag that served plain segments, and takes the mark off; its counter goes on."""
    await store.add_tag("order", 10)
    assert (await store.next_segment("order")).segment == Segment(1, 10)
    info = await store.set_permuted("order", True)
    assert (info.tag, info.permuted, info.max_id) == ("order", True, 11)
    assert await store.set_permuted("order", True) == info  # again: nothing changes
    assert [i.permuted for i in await store.list_tags()] == [True]
    assert (await store.next_segment("order")).segment == Segment(11, 20)
    assert not (await store.set_permuted("order", False)).permuted
    assert [i.permuted for i in await store.list_tags()] == [False]
    assert (await store.next_segment("order")).segment == Segment(21, 30)


async def test_marking_refuses_unknown_daily_and_far_up_tags(store: SegmentStore) -> None:
    """No such tag (a day row is none); a daily tag; a tag whose plain IDs could reach 10**18. Nothing marked."""
    with pytest.raises(UnknownTag):
        await store.set_permuted("nope", True)
    await store.add_tag("serial", 10, daily=DailyPolicy(6, "UTC"))
    await store.next_segment("serial@20261128")
    with pytest.raises(UnknownTag):
        await store.set_permuted("serial@20261128", True)
    with pytest.raises(BadRequest, match="daily"):
        await store.set_permuted("serial", True)
    await store.add_tag("high", 10, MAX_MARKED_MAX_ID + 1)
    with pytest.raises(BadRequest, match="10\\*\\*18"):
        await store.set_permuted("high", True)
    await store.add_tag("edge", 10, MAX_MARKED_MAX_ID)
    assert (await store.set_permuted("edge", True)).permuted
    assert not (await store.set_permuted("high", False)).permuted  # unmarking has no such limit
    assert {i.tag: i.permuted for i in await store.list_tags()} == {
        "edge": True,
        "high": False,
        "serial": False,
    }
