"""The hot path's JSON replies (``messages.JsonReplies``) are byte for byte what msgspec writes for a Reply."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dispenser.messages import JsonReplies, Reply, encode_reply

MAX_ID = 2**63 - 1
tags = st.from_regex(r"[A-Za-z0-9_.-]{1,128}", fullmatch=True)
# IDs near the places where the text changes shape: below 1,000 (no common prefix), at a power of ten
# (one digit more), at a block's edge, and anywhere up to 2**63 - 1.
firsts = st.one_of(
    st.integers(0, 3_000),
    st.sampled_from([10**k for k in range(3, 19)]).flatmap(lambda p: st.integers(p - 2_000, p + 2_000)),
    st.integers(0, MAX_ID),
)
counts = st.one_of(st.integers(1, 2_100), st.sampled_from([1, 100, 1_000, 10_000]))


def msgspec_ids(tag: str, first: int, last: int) -> bytes:
    return encode_reply(Reply(tag=tag, ids=list(range(first, last + 1))))


@given(tags, firsts, counts)
def test_ids_are_what_msgspec_writes(tag: str, first: int, count: int) -> None:
    """Any tag, any run of consecutive IDs: the same bytes as encoding the Reply with its list of IDs."""
    last = min(first + count - 1, MAX_ID)
    assert JsonReplies().ids(tag, first, last) == msgspec_ids(tag, first, last)


@given(tags, firsts, st.lists(st.tuples(st.integers(0, 5_000), counts), min_size=1, max_size=30))
def test_a_tag_s_requests_one_after_another_are_what_msgspec_writes(
    tag: str, first: int, requests: list[tuple[int, int]]
) -> None:
    """Requests in a row on one tag (gaps between them, blocks reused and moved): each the same bytes."""
    replies = JsonReplies()
    for gap, count in requests:
        first += gap
        last = first + count - 1
        if last > MAX_ID:
            break
        assert replies.ids(tag, first, last) == msgspec_ids(tag, first, last)
        first = last + 1


@given(st.lists(tags, min_size=1, max_size=5), firsts, st.lists(st.integers(0, 4), max_size=40))
def test_tags_taking_turns_each_get_their_own_ids(tags_: list[str], first: int, turns: list[int]) -> None:
    """Several tags' requests interleaved: no tag's reply carries another tag's name or text."""
    replies = JsonReplies()
    next_of = dict.fromkeys(tags_, min(first, MAX_ID - 10_000))
    for turn in turns:
        tag = tags_[turn % len(tags_)]
        start = next_of[tag]
        assert replies.ids(tag, start, start + 99) == msgspec_ids(tag, start, start + 99)
        next_of[tag] = start + 100 + turn * 997


@given(tags, firsts, counts)
def test_one_range_is_what_msgspec_writes(tag: str, first: int, count: int) -> None:
    """A ``ranges`` reply of one range: the same bytes as encoding the Reply."""
    last = min(first + count - 1, MAX_ID)
    expected = encode_reply(Reply(tag=tag, ranges=[(first, last)]))
    assert JsonReplies().one_range(tag, first, last) == expected


def test_many_tags_are_forgotten_not_confused() -> None:
    """Past the tags it keeps text for, the cache starts over: every reply still names its own tag."""
    replies = JsonReplies()
    for n in range(300):
        tag = f"tag-{n}"
        assert replies.ids(tag, 10**12 + n, 10**12 + n + 1) == msgspec_ids(tag, 10**12 + n, 10**12 + n + 1)
        assert replies.one_range(tag, 5, 6) == encode_reply(Reply(tag=tag, ranges=[(5, 6)]))
