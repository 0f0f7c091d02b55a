"""Dispatcher.reply_now, the NATS hot path's one call: the same replies as decode + answer_now, or a hand-off."""

from __future__ import annotations

import pytest

from dispenser.core import errors
from dispenser.messages import IdRequest
from dispenser.service.answering import Answer
from tests.unit.test_dispatcher import ScriptedSource, dispatcher

BODIES = [b"", b'{"count":1}', b'{"count":100}', b'{"count":7,"format":"ranges"}']


@pytest.mark.parametrize("body", BODIES)
def test_a_remembered_body_gets_the_reply_the_full_round_gives(body: bytes) -> None:
    """Once a body and tag were decoded, reply_now answers with the bytes decode + answer_now give."""
    sources = ScriptedSource(), ScriptedSource()
    for source in sources:
        source.next_id = 10**12  # 13 digits, as in production
    full, fast = (dispatcher(source) for source in sources)
    assert fast.reply_now("order", body) is None  # not seen yet: the caller does the full round
    fast.decode("order", body)
    for _ in range(3):
        expected = full.answer_now("order", full.decode("order", body))
        assert expected is not None
        assert fast.reply_now("order", body) == expected.body
    assert fast.inline == full.inline == 3


def test_an_unknown_tag_or_body_is_left_to_the_full_round() -> None:
    """A body seen for one tag says nothing of another tag, which is checked in the full round."""
    source = ScriptedSource()
    d = dispatcher(source)
    d.decode("order", b'{"count":2}')
    assert d.reply_now("other", b'{"count":2}') is None
    assert d.reply_now("order", b'{"count":3}') is None
    assert source.calls == 0  # nothing taken


def test_a_request_that_must_wait_is_handed_back_decoded() -> None:
    """IDs not at hand: the decoded request comes back, for answer() in a task; nothing is answered."""
    source = ScriptedSource()
    d = dispatcher(source)
    d.decode("order", b'{"count":5}')
    source.inline = False
    assert d.reply_now("order", b'{"count":5}') == IdRequest(count=5)
    assert d.inline == 0


def test_a_source_error_is_an_error_answer() -> None:
    """A refusal from the generator is the coded error answer, as answer_now gives it."""
    source = ScriptedSource()
    d = dispatcher(source)
    d.decode("order", b"")
    source.fail_with = errors.LeaseLost(3, "the session expired")
    answer = d.reply_now("order", b"")
    assert isinstance(answer, Answer)
    assert answer.error is source.fail_with
    assert d.errors == {"lease_lost": 1}
