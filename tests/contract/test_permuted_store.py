"""Permuted tags in the SegmentStore contract (docs/permuted.md), against the in-memory fake and PostgreSQL."""

from __future__ import annotations

import pytest

from dispenser.core.errors import TagExists
from dispenser.core.residue import Residue
from dispenser.core.segment import Segment
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
