"""The Dispatcher's sqids format: each ID as a 12-character string, on every path, plain and permuted tags."""

from __future__ import annotations

import msgspec
import pytest

from dispenser.core.permute import SPAN
from dispenser.core.sqids_form import MAX_SQIDS, from_sqid
from dispenser.messages import Reply, decode_request
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.testing.clock import ManualClock
from tests.unit.test_dispatch_permuted import PERMUTATION, dispatcher
from tests.unit.test_dispatcher import ScriptedSource


def sqids_reply(body: bytes, msgpack: bool = False) -> Reply:
    reply = msgspec.msgpack.decode(body, type=Reply) if msgpack else msgspec.json.decode(body, type=Reply)
    assert reply.error is None, reply.error
    assert reply.sqids is not None
    assert (reply.ids, reply.ranges) == (None, None)
    return reply


async def test_a_plain_tag_in_the_sqids_format_gives_its_counters_as_strings() -> None:
    """A plain tag may ask: the strings decode to the counters (they hide nothing); never the fast path."""
    d = Dispatcher(ScriptedSource(), ManualClock(), Limits())
    body = b'{"count": 3, "format": "sqids"}'
    d.decode("plain", b"{}")  # the tag is remembered as plain
    answer = d.answer_now("plain", d.decode("plain", body))
    assert answer is not None
    reply = sqids_reply(answer.body)
    assert [from_sqid(s) for s in reply.sqids or []] == [1, 2, 3]
    assert not reply.permuted
    assert d.reply_now("plain", body) is None  # not remembered: the fast path answers numbers only
    assert isinstance(d.reply_now("plain", b"{}"), bytes)  # the plain path untouched


async def test_a_permuted_tag_in_the_sqids_format_gives_its_permuted_ids_as_strings() -> None:
    """The strings decode to the permuted IDs of counters 1..: answer_now, answer, msgpack, a request_id."""
    source = ScriptedSource()
    d = dispatcher(source)
    now = d.answer_now("order", d.decode("order", b'{"count": 2, "format": "sqids"}'))
    assert now is not None
    got = sqids_reply(now.body).sqids or []
    source.inline = False
    later = await d.answer("order", d.decode("order", b'{"count": 2, "format": "sqids"}'))
    got += sqids_reply(later.body).sqids or []
    packed = msgspec.msgpack.encode({"count": 2, "format": "sqids"})
    got += (
        sqids_reply((await d.answer("order", d.decode("order", packed, True), True)).body, True).sqids or []
    )
    first = await d.answer("order", d.decode("order", b'{"count": 2, "format": "sqids", "request_id": "r"}'))
    again = await d.answer("order", d.decode("order", b'{"count": 2, "format": "sqids", "request_id": "r"}'))
    assert first.body == again.body  # a retry gets the same strings
    reply = sqids_reply(first.body)
    assert reply.permuted
    got += reply.sqids or []
    ids = [from_sqid(s) for s in got]
    assert all(SPAN <= i < 2 * SPAN for i in ids)
    assert [PERMUTATION.decode(i) for i in ids] == [(1, n) for n in range(1, 9)]


async def test_a_request_id_is_not_reused_across_formats() -> None:
    """The same request_id with the ids format after the sqids one is refused, as for ids and ranges."""
    d = dispatcher(ScriptedSource())
    await d.answer("order", d.decode("order", b'{"count": 2, "format": "sqids", "request_id": "r"}'))
    other = await d.answer("order", d.decode("order", b'{"count": 2, "request_id": "r"}'))
    assert other.error is not None
    assert other.error.code == "invalid"


@pytest.mark.parametrize(
    ("max_ids", "count", "code"),
    [
        (10, 10, None),
        (10, 11, "count_too_large"),  # limits.max_ids, not limits.max_ranges
        (2 * MAX_SQIDS, MAX_SQIDS, None),
        (2 * MAX_SQIDS, MAX_SQIDS + 1, "count_too_large"),  # each string ~11 µs in the event loop
    ],
)
@pytest.mark.parametrize("tag", ["plain", "order"])
async def test_the_sqids_format_is_limited(tag: str, max_ids: int, count: int, code: str | None) -> None:
    """At most limits.max_ids or MAX_SQIDS strings, whichever is lower, for a plain tag or a permuted one."""
    d = dispatcher(ScriptedSource(), max_ids=max_ids, max_ranges=1_000_000)
    answer = d.answer_now(tag, decode_request(b'{"count": %d, "format": "sqids"}' % count))
    assert answer is not None
    assert (None if answer.error is None else answer.error.code) == code
