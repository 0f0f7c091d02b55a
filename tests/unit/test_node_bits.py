"""Whether two workers' IDs can ever be equal, decided from the node bits they claim, checked by composing IDs.

The rule (:func:`dispenser.core.node_bits.can_collide`) must be sound (it never says "apart" of two
claims under which some ID is composed by both) and exact (when it says "may collide", an ID composed by
both exists), whatever the two layouts' widths, shifts and epochs.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from dispenser.core.node_bits import NodeBits, can_collide, node_bits
from dispenser.core.snowflake import LEAF_EPOCH_MS, SnowflakeLayout
from tests.strategies import datacenter_layouts, snowflake_layouts

LEAF = SnowflakeLayout()
TWITTER = SnowflakeLayout(datacenter_bits=5, worker_bits=5)

layouts = snowflake_layouts() | datacenter_layouts()


@st.composite
def claims(draw: st.DrawFn) -> tuple[SnowflakeLayout, int, int]:
    """A layout and a (datacenter, worker) pair that fits it."""
    layout = draw(layouts)
    return layout, draw(st.integers(0, layout.max_datacenter_id)), draw(st.integers(0, layout.max_worker_id))


def composes(layout: SnowflakeLayout, datacenter_id: int, worker_id: int, snowflake_id: int) -> bool:
    """Whether the worker ``(datacenter_id, worker_id)`` on ``layout`` can issue ``snowflake_id`` (any time, sequence)."""
    if not 0 <= snowflake_id <= layout.max_id:
        return False
    fields = layout.decompose(snowflake_id)
    if (fields.datacenter_id, fields.worker_id) != (datacenter_id, worker_id):
        return False
    # decompose() says which time and sequence; compose() confirms the worker issues exactly this ID then.
    return layout.compose(fields.timestamp_ms, worker_id, fields.sequence, datacenter_id) == snowflake_id


def test_leaf_worker_32_and_twitter_datacenter_1_worker_0_compose_the_same_ids() -> None:
    """The issue's pair: Leaf's 41 + 10 + 12 worker 32 and a 5 + 5 layout's datacenter 1, worker 0."""
    now = 1_790_000_000_000
    assert LEAF.compose(now, 32, 7) == TWITTER.compose(now, 0, 7, datacenter_id=1)
    assert can_collide(node_bits(LEAF, 0, 32), node_bits(TWITTER, 1, 0))
    assert not can_collide(node_bits(LEAF, 0, 33), node_bits(TWITTER, 1, 0))


def test_another_epoch_does_not_keep_one_node_apart() -> None:
    """Worker 5 on Leaf's epoch and on a later one: the later repeats the earlier's IDs, that much later."""
    later = SnowflakeLayout(epoch_ms=LEAF_EPOCH_MS + 86_400_000)
    t = 1_790_000_000_000
    assert LEAF.compose(t, 5, 0) == later.compose(t + 86_400_000, 5, 0)
    assert can_collide(node_bits(LEAF, 0, 5), node_bits(later, 0, 5))


picks = st.integers(0, 2**64)
"""Where in a field's range to pick a value (reduced modulo the range), so that explicit examples can say it."""


@given(claims(), claims(), picks, picks)
@example((LEAF, 0, 32), (TWITTER, 1, 0), 2**40, 7)  # the pair
@example((LEAF, 0, 1), (SnowflakeLayout(sequence_bits=11, worker_bits=11), 0, 2), 5, 0)  # shifted fields
def test_an_id_composed_by_both_exists_exactly_when_the_rule_says_they_may_collide(
    a: tuple[SnowflakeLayout, int, int], b: tuple[SnowflakeLayout, int, int], t_pick: int, sequence_pick: int
) -> None:
    """Sound: an ID of ``a`` that ``b`` also composes means "may collide". Exact: "may collide" has a witness."""
    bits_a, bits_b = node_bits(*a), node_bits(*b)
    verdict = can_collide(bits_a, bits_b)
    assert verdict == can_collide(bits_b, bits_a)
    # Soundness, sampled: any ID worker a composes that worker b composes too is a collision the rule saw.
    layout_a, dc_a, worker_a = a
    t = layout_a.epoch_ms + t_pick % (layout_a.max_timestamp_ms - layout_a.epoch_ms + 1)
    sequence = sequence_pick % (layout_a.max_sequence + 1)
    snowflake_id = layout_a.compose(t, worker_a, sequence, dc_a)
    if composes(*b, snowflake_id):
        assert verdict
    # ... and the same ID with worker b's node field written over it: if worker a still composes it, both do.
    layout_b, dc_b, worker_b = b
    field_b = ((1 << (layout_b.datacenter_bits + layout_b.worker_bits)) - 1) << layout_b.sequence_bits
    forced = (snowflake_id & ~field_b) | layout_b.node_part(dc_b, worker_b)
    if composes(*a, forced) and composes(*b, forced):
        assert verdict
    # Exactness: the smallest ID with both node fields set composes under both when the rule says so.
    witness = (bits_a.value << bits_a.shift) | (bits_b.value << bits_b.shift)
    assert verdict == (composes(*a, witness) and composes(*b, witness))


@given(claims(), st.data())
def test_the_same_layout_collides_only_on_the_same_node(
    a: tuple[SnowflakeLayout, int, int], data: st.DataObject
) -> None:
    """On one layout, the rule is the old one: equal (datacenter, worker) pairs, and only those."""
    layout, dc, worker = a
    other_dc = data.draw(st.integers(0, layout.max_datacenter_id))
    other_worker = data.draw(st.integers(0, layout.max_worker_id))
    same = (dc, worker) == (other_dc, other_worker)
    assert can_collide(node_bits(layout, dc, worker), node_bits(layout, other_dc, other_worker)) == same


def test_node_bits_say_where_the_worker_is() -> None:
    """Shift, width, value, ID width and epoch of a claim on Leaf's layout and Twitter's."""
    assert node_bits(LEAF, 0, 32) == NodeBits(
        shift=12, width=10, value=32, id_bits=63, epoch_ms=LEAF_EPOCH_MS
    )
    assert node_bits(TWITTER, 1, 0) == NodeBits(
        shift=12, width=10, value=32, id_bits=63, epoch_ms=LEAF_EPOCH_MS
    )
