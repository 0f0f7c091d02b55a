"""Spring's request/reply headers, as the Kafka adapters read and write them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dispenser.adapters.kafka.connection import decode_partition, encode_partition, header


@given(st.integers(0, 2**31 - 1))
def test_reply_partition_round_trips_in_springs_encoding(partition: int) -> None:
    """A partition written as Spring writes it (4-byte big-endian int) reads back the same."""
    raw = encode_partition(partition)
    assert len(raw) == 4
    assert decode_partition(raw) == partition


def test_reply_partition_in_ascii_digits_is_accepted() -> None:
    """Non-Spring clients may send the partition as text."""
    assert decode_partition(b"3") == 3
    assert decode_partition(b"12") == 12


def test_an_unreadable_reply_partition_is_none() -> None:
    """Neither 4 bytes nor digits (or a negative int): no partition, Kafka picks one."""
    assert decode_partition(b"abc") is None
    assert decode_partition(encode_partition(-1)) is None


def test_header_lookup_takes_the_last_value_case_insensitively() -> None:
    """Headers may repeat; the last one wins, and names match whatever their case."""
    headers = [("Content-Type", b"a"), ("x", b"1"), ("content-type", b"b")]
    assert header(headers, "content-type") == b"b"
    assert header(headers, "missing") is None
