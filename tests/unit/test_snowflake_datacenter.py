"""The datacenter field of the snowflake layout (Twitter's 5 + 5 bits).

Leaf's layout is unchanged without it; with it, every (datacenter, worker) pair has IDs of its own.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.config import SnowflakeConfig
from dispenser.core.errors import InvalidLayout, WorkerIdOutOfRange
from dispenser.core.snowflake import LEAF_EPOCH_MS, Issued, SnowflakeLayout, SnowflakeState
from dispenser.registries import layout_of
from dispenser.service.decode import decode_id
from tests.strategies import datacenter_layouts, layout_fields, snowflake_layouts

TWITTER = SnowflakeLayout(datacenter_bits=5, worker_bits=5)
NOW = 1_700_000_000_000


@given(snowflake_layouts(), st.data())
def test_without_datacenter_bits_ids_are_leafs_bit_for_bit(
    layout: SnowflakeLayout, data: st.DataObject
) -> None:
    """The default (0 datacenter bits) composes exactly Leaf's ``timestamp | worker | sequence``."""
    timestamp_ms, worker_id, sequence = data.draw(layout_fields(layout))
    leaf = (
        ((timestamp_ms - layout.epoch_ms) << (layout.worker_bits + layout.sequence_bits))
        | (worker_id << layout.sequence_bits)
        | sequence
    )
    assert layout.datacenter_bits == 0
    assert layout.compose(timestamp_ms, worker_id, sequence) == leaf
    assert layout.decompose(leaf).datacenter_id == 0


def test_the_generator_without_datacenter_bits_issues_what_it_did() -> None:
    """Same seed, same clock: the default layout's state issues the IDs Leaf's formula gives."""
    issued = SnowflakeState(SnowflakeLayout(), 7, rng=random.Random(3)).issue(NOW, 5)
    assert isinstance(issued, Issued)
    first = issued.ranges[0][0]
    start = random.Random(3).randrange(100)
    assert first == ((NOW - LEAF_EPOCH_MS) << 22) | (7 << 12) | start


@given(datacenter_layouts(), st.data())
def test_compose_and_decompose_round_trip(layout: SnowflakeLayout, data: st.DataObject) -> None:
    """Every field that fits comes back out of the ID it went into."""
    timestamp_ms, worker_id, sequence = data.draw(layout_fields(layout))
    datacenter_id = data.draw(st.integers(0, layout.max_datacenter_id))
    snowflake_id = layout.compose(timestamp_ms, worker_id, sequence, datacenter_id)
    assert 0 <= snowflake_id <= layout.max_id
    fields = layout.decompose(snowflake_id)
    assert (fields.timestamp_ms, fields.datacenter_id, fields.worker_id, fields.sequence) == (
        timestamp_ms,
        datacenter_id,
        worker_id,
        sequence,
    )


@given(datacenter_layouts(), st.data())
def test_two_distinct_datacenter_worker_pairs_never_share_an_id(
    layout: SnowflakeLayout, data: st.DataObject
) -> None:
    """Whatever the times and sequences, (dc1, w1) != (dc2, w2) gives different IDs."""
    nodes = st.tuples(st.integers(0, layout.max_datacenter_id), st.integers(0, layout.max_worker_id))
    first, second = data.draw(st.lists(nodes, min_size=2, max_size=2, unique=True))
    t1, _, s1 = data.draw(layout_fields(layout))
    t2, _, s2 = data.draw(layout_fields(layout))
    a = layout.compose(t1, first[1], s1, first[0])
    b = layout.compose(t2, second[1], s2, second[0])
    assert a != b


@given(
    st.tuples(st.integers(0, 31), st.integers(0, 31)),
    st.tuples(st.integers(0, 31), st.integers(0, 31)),
    st.integers(NOW, NOW + 1000),
    st.integers(1, 4096),
    st.integers(1, 4096),
)
def test_two_generators_of_distinct_pairs_issue_disjoint_ranges(
    one: tuple[int, int], other: tuple[int, int], now_ms: int, n1: int, n2: int
) -> None:
    """Two workers in the same millisecond, Twitter's layout: their ranges never overlap unless same pair."""
    a = SnowflakeState(TWITTER, one[1], datacenter_id=one[0], rng=random.Random(1)).issue(now_ms, n1)
    b = SnowflakeState(TWITTER, other[1], datacenter_id=other[0], rng=random.Random(1)).issue(now_ms, n2)
    assert isinstance(a, Issued)
    assert isinstance(b, Issued)
    (a_first, a_last), (b_first, b_last) = a.ranges[0], b.ranges[0]
    overlap = a_first <= b_last and b_first <= a_last
    assert overlap == (one == other)


def test_the_datacenter_sits_above_the_worker() -> None:
    """Twitter's layout: 41 + 5 + 5 + 12, the datacenter in bits 17-21, the worker in bits 12-16."""
    snowflake_id = TWITTER.compose(LEAF_EPOCH_MS, 3, 0, datacenter_id=2)
    assert snowflake_id == (2 << 17) | (3 << 12)
    assert TWITTER.max_datacenter_id == 31
    assert TWITTER.max_worker_id == 31


def test_layout_refuses_a_datacenter_field_that_overflows_63_bits() -> None:
    with pytest.raises(InvalidLayout, match="datacenter_bits 1"):
        SnowflakeLayout(datacenter_bits=1)  # 41 + 1 + 10 + 12 = 64
    with pytest.raises(InvalidLayout, match="must not be negative"):
        SnowflakeLayout(datacenter_bits=-1, worker_bits=5)


def test_a_datacenter_id_that_does_not_fit_is_refused() -> None:
    with pytest.raises(WorkerIdOutOfRange, match="datacenter ID 32"):
        SnowflakeState(TWITTER, 0, datacenter_id=32)
    with pytest.raises(WorkerIdOutOfRange, match=r"datacenter ID 1 .* between 0 and 0"):
        layout_of(SnowflakeConfig(datacenter_id=1))  # no datacenter bits: only datacenter 0
    with pytest.raises(WorkerIdOutOfRange, match="datacenter ID -1"):
        TWITTER.compose(NOW, 0, 0, datacenter_id=-1)


def test_decode_shows_the_datacenter_only_with_datacenter_bits() -> None:
    leaf = SnowflakeLayout()
    assert decode_id(leaf, leaf.compose(NOW, 5, 9)).datacenter_id is None
    reply = decode_id(TWITTER, TWITTER.compose(NOW, 5, 9, datacenter_id=17))
    assert (reply.datacenter_id, reply.worker_id, reply.sequence, reply.timestamp_ms) == (17, 5, 9, NOW)
    config = SnowflakeConfig(datacenter_bits=5, worker_bits=5, datacenter_id=17)
    assert layout_of(config) == TWITTER
