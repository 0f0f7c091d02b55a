"""A permuted tag's replies say ``"permuted": true`` on every path; a plain tag's replies stay as they were."""

from __future__ import annotations

import msgspec
import pytest

from dispenser.messages import Reply
from tests.unit.test_dispatch_permuted import dispatcher
from tests.unit.test_dispatcher import ScriptedSource


def decoded(body: bytes) -> Reply:
    return msgspec.json.decode(body, type=Reply)


@pytest.mark.parametrize(
    "body",
    [
        b'{"count": 1}',
        b'{"count": 3}',
        b'{"count": 1, "format": "ranges"}',
        b'{"count": 2, "format": "ranges"}',
    ],
)
async def test_every_answer_of_a_permuted_tag_is_marked(body: bytes) -> None:
    """answer_now, answer and a request_id's answer of a permuted tag carry permuted=true, one ID a range."""
    d = dispatcher(ScriptedSource())
    now = d.answer_now("order", d.decode("order", body))
    assert now is not None
    waited = await d.answer("order", d.decode("order", body))
    with_id = await d.answer("order", d.decode("order", body[:-1] + b', "request_id": "r"}'))
    for answer in (now, waited, with_id):
        reply = decoded(answer.body)
        assert reply.permuted
        assert reply.ranges is None or all(first == last for first, last in reply.ranges)


async def test_a_plain_tag_beside_it_is_not_marked_and_its_bytes_are_unchanged() -> None:
    """No "permuted" key in a plain tag's reply, on the fast path or with a request_id."""
    d = dispatcher(ScriptedSource())
    d.decode("plain", b'{"count": 2}')
    fast = d.reply_now("plain", b'{"count": 2}')
    assert fast == b'{"tag":"plain","ids":[1,2]}'
    answer = await d.answer(
        "plain", d.decode("plain", b'{"count": 2, "format": "ranges", "request_id": "r"}')
    )
    assert b"permuted" not in answer.body
    assert not decoded(answer.body).permuted
