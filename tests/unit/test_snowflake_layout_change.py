"""Changing a running fleet's layout (docs/snowflake.md, "Changing the layout"), checked by composing IDs.

A later epoch makes the new layout's timestamps smaller: its IDs repeat ones the old layout issued
earlier. What keeps every new ID above every old one is an epoch no later than the old one, no fewer bits
below the timestamp, and a start after the old layout's last millisecond.
"""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from dispenser.core.snowflake import LEAF_EPOCH_MS, SnowflakeLayout
from tests.strategies import DATETIME_MAX_MS, MAX_TIMESTAMP_BITS, datacenter_layouts, snowflake_layouts

LEAF = SnowflakeLayout()
DAY_MS = 86_400_000


def test_a_later_epoch_repeats_ids_issued_before_the_switch() -> None:
    """The advice once given ("start the new layout with a later epoch"): the new IDs equal old ones."""
    switch = 1_790_000_000_000
    old = LEAF.compose(switch - DAY_MS, 32, 7)  # issued by the old layout's worker 32 a day before the switch
    same_fields = SnowflakeLayout(epoch_ms=LEAF_EPOCH_MS + DAY_MS)
    assert same_fields.compose(switch, 32, 7) == old
    twitter = SnowflakeLayout(epoch_ms=LEAF_EPOCH_MS + DAY_MS, datacenter_bits=5, worker_bits=5)
    assert twitter.compose(switch, 0, 7, datacenter_id=1) == old


@st.composite
def layout_changes(draw: st.DrawFn) -> tuple[SnowflakeLayout, SnowflakeLayout, int, int]:
    """An old layout, a new one (an epoch no later, no fewer bits below the timestamp), two milliseconds.

    The old layout's last millisecond, and the new one's first (later, within both layouts' ranges).
    """
    old = draw(snowflake_layouts() | datacenter_layouts())
    low = draw(st.integers(old.timestamp_shift, 62))  # the new bits below the timestamp
    sequence_bits = draw(st.integers(0, low))
    datacenter_bits = draw(st.integers(0, low - sequence_bits))
    timestamp_bits = draw(st.integers(1, min(63 - low, MAX_TIMESTAMP_BITS)))
    latest = min(old.epoch_ms, DATETIME_MAX_MS - (1 << timestamp_bits) + 1)  # the layout must end by 9999
    epoch_ms = draw(st.integers(max(0, old.epoch_ms - (1 << timestamp_bits) + 2), latest))
    new = SnowflakeLayout(
        timestamp_bits=timestamp_bits,
        datacenter_bits=datacenter_bits,
        worker_bits=low - sequence_bits - datacenter_bits,
        sequence_bits=sequence_bits,
        epoch_ms=epoch_ms,
    )
    last_old = draw(st.integers(old.epoch_ms, min(old.max_timestamp_ms, new.max_timestamp_ms - 1)))
    first_new = draw(st.integers(last_old + 1, new.max_timestamp_ms))
    return old, new, last_old, first_new


@given(layout_changes(), st.data())
def test_an_epoch_no_later_and_no_fewer_low_bits_put_every_new_id_above_every_old_one(
    change: tuple[SnowflakeLayout, SnowflakeLayout, int, int], data: st.DataObject
) -> None:
    """The largest ID the old layout can have issued by its last millisecond is below the new one's smallest."""
    old, new, last_old, first_new = change
    largest_old = old.compose(last_old, old.max_worker_id, old.max_sequence, old.max_datacenter_id)
    new_dc = data.draw(st.integers(0, new.max_datacenter_id))
    new_worker = data.draw(st.integers(0, new.max_worker_id))
    assert new.compose(first_new, new_worker, 0, new_dc) > largest_old


@given(snowflake_layouts(), st.integers(1, 1_000 * DAY_MS))
def test_with_a_later_epoch_some_new_id_is_an_old_one(layout: SnowflakeLayout, later_by: int) -> None:
    """Whatever the fields: the same worker on an epoch ``d`` later issues at ``t + d`` what it issued at ``t``."""
    assume(layout.max_timestamp_ms + later_by <= DATETIME_MAX_MS)
    later = SnowflakeLayout(
        timestamp_bits=layout.timestamp_bits,
        worker_bits=layout.worker_bits,
        sequence_bits=layout.sequence_bits,
        epoch_ms=layout.epoch_ms + later_by,
    )
    t = layout.epoch_ms + later_by  # issued by the old layout; the new one reaches it later_by ms later
    assume(t <= layout.max_timestamp_ms)
    assert later.compose(t + later_by, 0, 0) == layout.compose(t, 0, 0)
