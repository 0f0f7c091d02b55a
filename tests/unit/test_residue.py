"""Residue classes (the topology without a shared database): the segment math, and its properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.residue import LEAF, MAX_STRIDE, Residue, StridedRange
from dispenser.core.segment import NEED_SEGMENT, Segment, SegmentBuffer


def test_leafs_tag_grants_what_leaf_grants() -> None:
    """Stride 1: the grant is Leaf's segment, and ordinals are the IDs themselves."""
    granted = LEAF.grant(1001, 1000)
    assert granted == StridedRange(1, 1000, 1)
    assert LEAF.to_ordinals(granted) == Segment.from_max_id(1001, 1000)
    assert LEAF.ids((5, 9)) == StridedRange(5, 9, 1)


def test_a_strided_grant_holds_step_ids_of_its_class_below_max_id() -> None:
    """Stride 2, offset 1 (odd IDs): max_id 1 → 21 grants 1, 3, …, 19; offset 0 grants 2, …, 20."""
    odd, even = Residue(2, 1), Residue(2, 0)
    assert odd.grant(21, 10).to_list() == list(range(1, 20, 2))
    assert even.grant(21, 10).to_list() == list(range(2, 21, 2))
    assert odd.advance(10) == 20


def test_bad_classes_are_refused() -> None:
    """Offsets lie in [0, stride); strides in [1, MAX_STRIDE]."""
    for stride, offset in ((0, 0), (2, 2), (2, -1), (MAX_STRIDE + 1, 0)):
        with pytest.raises(ValueError, match=r"^(stride|offset) must be between"):
            Residue(stride, offset)
    with pytest.raises(ValueError, match="is not 1 modulo 2"):
        Residue(2, 1).ordinal(4)


classes = st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1)))


@given(cls=classes, start=st.integers(1, 10**12), step=st.integers(1, 5000))
def test_a_grant_is_exactly_step_members_of_the_class_inside_the_advance(
    cls: tuple[int, int], start: int, step: int
) -> None:
    """Whatever max_id (aligned or not), a grant holds step IDs of the class, all in the half-open advance."""
    residue = Residue(*cls)
    max_id = start + residue.advance(step)
    granted = residue.grant(max_id, step)
    assert granted.count == step
    assert start <= granted.first
    assert granted.last < max_id
    assert residue.owns(granted.first)
    assert residue.owns(granted.last)
    segment = residue.to_ordinals(granted)
    assert segment.size == step
    assert residue.ids((segment.first, segment.last)) == granted


@given(
    stride=st.integers(2, 16),
    data=st.data(),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 200)), min_size=1, max_size=25),
    starts=st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)),
)
def test_two_datacenters_ranges_never_intersect(
    stride: int, data: st.DataObject, steps: list[tuple[bool, int]], starts: tuple[int, int]
) -> None:
    """Two databases, one stride, two offsets: whatever each one's max_id and steps, no ID in both.

    Each datacenter's IDs also increase strictly from one segment to the next (trend-increasing).
    """
    offsets = data.draw(st.lists(st.integers(0, stride - 1), min_size=2, max_size=2, unique=True))
    residues = (Residue(stride, offsets[0]), Residue(stride, offsets[1]))
    max_ids = list(starts)
    issued: tuple[list[int], list[int]] = ([], [])
    for in_b, step in steps:
        dc = int(in_b)
        max_ids[dc] += residues[dc].advance(step)
        granted = residues[dc].grant(max_ids[dc], step).to_list()
        if issued[dc]:
            assert granted[0] > issued[dc][-1]
        issued[dc].extend(granted)
    assert not set(issued[0]) & set(issued[1])
    for dc in (0, 1):
        assert issued[dc] == sorted(set(issued[dc]))


@given(
    cls=classes,
    steps=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    counts=st.lists(st.integers(1, 80), min_size=1, max_size=20),
)
def test_the_double_buffer_over_ordinals_hands_out_each_granted_id_once_in_order(
    cls: tuple[int, int], steps: list[int], counts: list[int]
) -> None:
    """Granted ranges through the (unchanged) buffer and back: the granted IDs, once each, increasing."""
    residue = Residue(*cls)
    buf = SegmentBuffer()
    max_id = 1
    granted: list[int] = []
    for step in steps:
        max_id += residue.advance(step) + 3  # + 3: another writer moved max_id meanwhile (a gap)
        grant = residue.grant(max_id, step)
        granted.extend(grant.to_list())
        buf.install(residue.to_ordinals(grant), now=0.0)
    issued: list[int] = []
    for count in counts:
        batch = buf.take(count)
        if batch is NEED_SEGMENT:
            continue
        ids = residue.batch(batch)
        assert ids.count == count
        for first, last in ids.ranges:
            issued.extend(range(first, last + 1))
    assert issued == granted[: len(issued)]
    assert issued == sorted(set(issued))
    assert all(residue.owns(i) for i in issued)


# -- which classes share an ID (two databases must never serve intersecting classes of one tag) ----------

small_classes = st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1)))


def test_intersecting_classes_from_the_issue() -> None:
    """0 mod 2 and 1 mod 3 share 4; 0 mod 2 and 1 mod 2 share nothing; a plain tag shares with every class."""
    assert Residue(2, 0).intersects(Residue(3, 1))
    assert Residue(2, 0).first_common(Residue(3, 1)) == 4
    assert not Residue(2, 0).intersects(Residue(2, 1))
    assert Residue(2, 0).first_common(Residue(2, 1)) is None
    assert Residue(2, 0).intersects(Residue(2, 0))
    assert LEAF.intersects(Residue(4, 3))
    assert not Residue(4, 1).intersects(Residue(6, 2))  # gcd 2: 1 and 2 differ modulo 2


@given(a=small_classes, b=small_classes)
def test_intersection_agrees_with_brute_force(a: tuple[int, int], b: tuple[int, int]) -> None:
    """``intersects`` and ``first_common`` agree with a search over one period (lcm) of both classes."""
    one, other = Residue(*a), Residue(*b)
    period = math.lcm(one.stride, other.stride)
    shared = [x for x in range(period) if one.owns(x) and other.owns(x)]
    assert one.intersects(other) == bool(shared) == other.intersects(one)
    assert one.first_common(other) == (shared[0] if shared else None) == other.first_common(one)


@given(a=classes, b=classes)
def test_a_common_id_is_in_both_classes(a: tuple[int, int], b: tuple[int, int]) -> None:
    """Up to stride 64: ``first_common`` is a member of both classes below their lcm, when it exists."""
    one, other = Residue(*a), Residue(*b)
    common = one.first_common(other)
    if common is None:
        assert (one.offset - other.offset) % math.gcd(one.stride, other.stride)
    else:
        assert one.owns(common)
        assert other.owns(common)
        assert common < math.lcm(one.stride, other.stride)
