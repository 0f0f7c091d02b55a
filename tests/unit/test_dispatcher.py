"""The Dispatcher, where every request becomes a reply: the error mapping, request_id reuse, msgpack."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import pytest

from dispenser.core import errors
from dispenser.messages import Reply
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.testing.clock import ManualClock


@dataclass(frozen=True)
class Ranges:
    ranges: Sequence[tuple[int, int]]


class ScriptedSource:
    """An IdSource that hands out consecutive IDs, or raises what the test told it to."""

    def __init__(self) -> None:
        self.next_id = 1
        self.fail_with: Exception | None = None
        self.inline = True
        self.calls = 0

    def _take(self, count: int) -> Ranges:
        self.calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        first, self.next_id = self.next_id, self.next_id + count
        return Ranges(((first, first + count - 1),))

    def try_take(self, tag: str, count: int) -> Ranges | None:
        return self._take(count) if self.inline else None

    async def take(self, tag: str, count: int, deadline: float) -> Ranges:
        return self._take(count)


def dispatcher(source: ScriptedSource, **limits: int) -> Dispatcher:
    return Dispatcher(source, ManualClock(), Limits(**limits))


def reply(body: bytes, msgpack: bool = False) -> Reply:
    return msgspec.msgpack.decode(body, type=Reply) if msgpack else msgspec.json.decode(body, type=Reply)


# Every error the generators raise, and what the client must see: (code, retryable).
SOURCE_ERRORS: list[tuple[errors.DispenserError, str, bool]] = [
    (errors.UnknownTag("t"), "unknown_tag", False),
    (errors.StoreUnavailable("down"), "unavailable", True),
    (errors.CoordinatorUnavailable("zk down"), "unavailable", True),
    (errors.TagExhausted("t", "past 2^63 - 1"), "tag_exhausted", False),
    (errors.LeaseLost(3, "the session expired"), "lease_lost", True),
    (errors.ClockBehindRecorded(2_000, 1_000), "clock_behind_recorded", True),
    (errors.KindNotServed("segment", ["snowflake"]), "kind_not_served", False),
]


@pytest.mark.parametrize(("exc", "code", "retryable"), SOURCE_ERRORS, ids=[c for _, c, _ in SOURCE_ERRORS])
async def test_each_source_error_becomes_its_coded_reply(
    exc: errors.DispenserError, code: str, retryable: bool
) -> None:
    """Inline and waiting paths alike: the error's code, retryable flag and message, and a count by code."""
    source = ScriptedSource()
    source.fail_with = exc
    d = dispatcher(source)
    now = d.answer_now("t", d.decode("t", b'{"count": 2}'))
    assert now is not None
    later = await d.answer("t", d.decode("t", b'{"count": 2, "request_id": "r"}'))
    for answer in (now, later):
        assert answer.error is exc
        error = reply(answer.body).error
        assert error is not None
        assert (error.code, error.retryable, error.message) == (code, retryable, exc.message)
    assert d.errors == {code: 2}


async def test_an_unexpected_exception_is_an_internal_error_naming_no_detail() -> None:
    """A bug in a generator: an `internal` reply (type named, message not leaked), and the worker goes on."""
    source = ScriptedSource()
    source.fail_with = KeyError("secret detail")
    d = dispatcher(source)
    now = d.answer_now("t", d.decode("t", b""))
    assert now is not None
    error = reply(now.body).error
    assert error is not None
    assert error.code == "internal"
    assert "KeyError" in error.message
    assert "secret detail" not in error.message
    source.fail_with = None
    ok = d.answer_now("t", d.decode("t", b""))
    assert ok is not None
    assert ok.error is None
    assert reply(ok.body).ids is not None


BAD_REQUESTS: list[tuple[str, bytes, str]] = [
    ("t", b"{not json", "malformed"),
    ("t", b'{"count": "five"}', "invalid"),
    ("t", b'{"count": 1, "colour": "red"}', "invalid"),
    ("t", b'{"format": "csv"}', "invalid"),
    ("t", b'{"request_id": ""}', "invalid"),
    ("t", b'{"count": 0}', "invalid_count"),
    ("t", b'{"count": -3}', "invalid_count"),
    ("t", b'{"count": 101}', "count_too_large"),
    ("t", b'{"count": 1001, "format": "ranges"}', "count_too_large"),
    ("bad tag!", b"", "invalid_tag"),
    ("t", b" " * 300, "too_large"),
]


@pytest.mark.parametrize(
    ("tag", "body", "code"), BAD_REQUESTS, ids=[f"{c}:{b[:12]!r}" for _, b, c in BAD_REQUESTS]
)
async def test_bad_requests_get_a_clear_non_retryable_reply_and_take_no_ids(
    tag: str, body: bytes, code: str
) -> None:
    """Bad input: refused by decode with its own code, not retryable, and the generator was never asked."""
    source = ScriptedSource()
    d = dispatcher(source, max_ids=100, max_ranges=1000, max_body_bytes=256)
    for _ in range(2):  # the second time, with the tag and body caches warm: refused all the same
        with pytest.raises(errors.BadRequest) as refused:
            d.decode(tag, body)
        answer = d.error(tag, refused.value)
        assert answer.error is refused.value
        error = reply(answer.body).error
        assert error is not None
        assert (error.code, error.retryable) == (code, False)
        assert error.message
    assert source.calls == 0


async def test_a_request_id_reused_with_other_parameters_is_invalid() -> None:
    """The same request_id: same IDs; with another count or format: `invalid`, and no new IDs drawn."""
    source = ScriptedSource()
    d = dispatcher(source)
    first = await d.answer("t", d.decode("t", b'{"count": 3, "request_id": "r"}'))
    again = await d.answer("t", d.decode("t", b'{"count": 3, "request_id": "r"}'))
    assert first.body == again.body
    for body in (b'{"count": 4, "request_id": "r"}', b'{"count": 3, "request_id": "r", "format": "ranges"}'):
        changed = await d.answer("t", d.decode("t", body))
        error = reply(changed.body).error
        assert error is not None
        assert error.code == "invalid"
        assert "request_id 'r'" in error.message
    assert source.calls == 1


async def test_msgpack_in_msgpack_out_for_ids_ranges_and_errors() -> None:
    """A msgpack request gets a msgpack reply, errors included."""
    source = ScriptedSource()
    d = dispatcher(source)
    ids = d.answer_now("t", d.decode("t", msgspec.msgpack.encode({"count": 3}), msgpack=True), msgpack=True)
    assert ids is not None
    assert reply(ids.body, msgpack=True).ids == [1, 2, 3]
    ranges_request = d.decode("t", msgspec.msgpack.encode({"count": 5, "format": "ranges"}), msgpack=True)
    ranges = await d.answer("t", ranges_request, msgpack=True)
    assert reply(ranges.body, msgpack=True).ranges == [(4, 8)]
    with pytest.raises(errors.MalformedRequest) as refused:
        d.decode("t", b"\xc1", msgpack=True)  # 0xc1 is never valid msgpack
    bad = d.error("t", refused.value, msgpack=True)
    error = reply(bad.body, msgpack=True).error
    assert error is not None
    assert error.code == "malformed"


async def test_the_inline_path_and_the_waiting_path_give_the_same_reply() -> None:
    """A body answered inline and the same body answered after a wait encode alike (IDs aside)."""
    source = ScriptedSource()
    d = dispatcher(source)
    inline = d.answer_now("order", d.decode("order", b'{"count": 2}'))
    source.inline = False
    request = d.decode("order", b'{"count": 2}')
    assert d.answer_now("order", request) is None  # the source would have to wait
    waited = await d.answer("order", request)
    assert inline is not None
    assert reply(inline.body) == Reply(tag="order", ids=[1, 2])
    assert reply(waited.body) == Reply(tag="order", ids=[3, 4])
    assert d.inline == 1
    assert sum(d.waited) == 1


async def test_snowflake_decode_goes_through_the_same_checks() -> None:
    """leaf.snowflake.decode: the body limit first, JSON or msgpack in and out, coded errors."""
    from dispenser.core.snowflake import SnowflakeLayout  # noqa: PLC0415
    from dispenser.messages import DecodeReply  # noqa: PLC0415
    from dispenser.service.decode import decode_handler  # noqa: PLC0415

    layout = SnowflakeLayout()
    handle = decode_handler(layout, max_body_bytes=64)
    snowflake_id = layout.compose(layout.epoch_ms + 1_000, 3, 7)
    ok = await handle(msgspec.msgpack.encode({"id": snowflake_id}), True)
    decoded = msgspec.msgpack.decode(ok.body, type=DecodeReply)
    assert (decoded.worker_id, decoded.sequence) == (3, 7)
    cases = [(b" " * 65, False, "too_large"), (b"{", False, "malformed"), (b"\xc1", True, "malformed")]
    cases += [(b'{"id": "x"}', False, "invalid"), (b'{"id": -1}', False, "invalid")]
    cases += [(b'{"id": %d}' % 2**63, False, "invalid_id")]  # wider than the layout
    for body, msgpack, code in cases:
        answer = await handle(body, msgpack)
        reply_body = msgspec.msgpack.decode(answer.body, type=DecodeReply) if msgpack else None
        reply_body = reply_body or msgspec.json.decode(answer.body, type=DecodeReply)
        assert answer.error is not None
        assert reply_body.error is not None
        assert reply_body.error.code == code, (body, reply_body.error)
