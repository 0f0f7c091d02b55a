"""Hypothesis strategies shared by the unit tests: one module, so every test draws from the same shapes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from dispenser.core.snowflake import LEAF_EPOCH_MS, SnowflakeLayout

# Computed here rather than imported, so that the tests don't trust the module they test for it.
_LAST_DATETIME = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
DATETIME_MAX_MS = (_LAST_DATETIME - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
# The widest timestamp field that can still end before 9999 (from a 1970 epoch).
MAX_TIMESTAMP_BITS = DATETIME_MAX_MS.bit_length() - 1


@st.composite
def snowflake_layouts(draw: st.DrawFn) -> SnowflakeLayout:
    """Any valid layout: widths summing to at most 63 bits, an epoch that keeps the end before 9999."""
    timestamp_bits = draw(st.integers(1, MAX_TIMESTAMP_BITS))
    worker_bits = draw(st.integers(0, 63 - timestamp_bits))
    sequence_bits = draw(st.integers(0, 63 - timestamp_bits - worker_bits))
    max_epoch = DATETIME_MAX_MS - (1 << timestamp_bits) + 1
    epochs = st.integers(0, max_epoch)
    if max_epoch >= LEAF_EPOCH_MS:
        epochs = st.just(LEAF_EPOCH_MS) | epochs
    return SnowflakeLayout(
        timestamp_bits=timestamp_bits,
        worker_bits=worker_bits,
        sequence_bits=sequence_bits,
        epoch_ms=draw(epochs),
    )


@st.composite
def datacenter_layouts(draw: st.DrawFn) -> SnowflakeLayout:
    """Any valid layout with datacenter bits (at least 1): the four widths sum to at most 63 bits."""
    timestamp_bits = draw(st.integers(1, min(MAX_TIMESTAMP_BITS, 62)))
    datacenter_bits = draw(st.integers(1, 63 - timestamp_bits))
    worker_bits = draw(st.integers(0, 63 - timestamp_bits - datacenter_bits))
    sequence_bits = draw(st.integers(0, 63 - timestamp_bits - datacenter_bits - worker_bits))
    return SnowflakeLayout(
        timestamp_bits=timestamp_bits,
        datacenter_bits=datacenter_bits,
        worker_bits=worker_bits,
        sequence_bits=sequence_bits,
        epoch_ms=draw(st.integers(0, DATETIME_MAX_MS - (1 << timestamp_bits) + 1)),
    )


def layout_fields(layout: SnowflakeLayout) -> st.SearchStrategy[tuple[int, int, int]]:
    """``(timestamp_ms, worker_id, sequence)`` triples that fit ``layout``."""
    return st.tuples(
        st.integers(layout.epoch_ms, layout.max_timestamp_ms),
        st.integers(0, layout.max_worker_id),
        st.integers(0, layout.max_sequence),
    )


clock_moves: st.SearchStrategy[int | None] = st.one_of(
    st.none(),  # the shell slept as told (or, with nothing to wait for, read the clock again at once)
    st.integers(0, 2),  # same millisecond, or the next ones
    st.integers(-12, -1),  # small rollbacks, either side of the default 5 ms tolerance
    st.integers(-100_000, 100_000),  # jumps, NTP steps, a clock reset
)
"""How the wall clock moves between two readings: ``None`` means "sleep until the WaitUntil", else a delta."""

request_counts = st.integers(1, 10_000)
"""How many IDs one request asks for: from one up to a few milliseconds' worth of the default layout."""
