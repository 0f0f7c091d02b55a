"""The Dispatcher with a permuted tag: permuted IDs on every path, plain tags untouched, the store's marks."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from dispenser.core.errors import BadRequest
from dispenser.core.permute import SPAN, Permutation
from dispenser.messages import Reply
from dispenser.ports import SystemClock, TagInfo
from dispenser.service.dispatch import MAX_PERMUTED_IDS, Dispatcher, Limits
from dispenser.service.permuted import MarkingStore, PermutedMarks, load_permutation, load_permutations
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing import MemorySegmentStore
from dispenser.testing.clock import ManualClock
from tests.unit.test_dispatcher import ScriptedSource

KEY = "2DE79D232DF5585D68CE47882AE256D6"
PERMUTATION = Permutation("order", {1: bytes.fromhex(KEY)})


def dispatcher(source: ScriptedSource, **limits: int) -> Dispatcher:
    return Dispatcher(source, ManualClock(), Limits(**limits), permuted={"order": PERMUTATION})


def ids_of(body: bytes) -> list[int]:
    reply = msgspec.json.decode(body, type=Reply)
    if reply.ranges is not None:
        return [first for first, last in reply.ranges if first == last]
    assert reply.ids is not None
    return reply.ids


async def test_every_path_answers_the_permuted_ids_of_the_counters() -> None:
    """reply_now, answer_now, answer and a request_id answer: permuted IDs of counters 1.., decodable."""
    source = ScriptedSource()
    d = dispatcher(source)
    body = b'{"count": 3}'
    assert d.reply_now("order", body) is None  # never on the remembered fast path
    now = d.answer_now("order", d.decode("order", body))
    assert now is not None
    got = ids_of(now.body)
    got += ids_of((await d.answer("order", d.decode("order", b'{"count": 2, "format": "ranges"}'))).body)
    got += ids_of((await d.answer("order", d.decode("order", b'{"count": 2, "request_id": "r"}'))).body)
    assert [PERMUTATION.decode(i) for i in got] == [(1, n) for n in range(1, 8)]
    assert all(i >= SPAN for i in got)
    assert got != sorted(got)


async def test_plain_tags_beside_a_permuted_one_are_untouched() -> None:
    """A plain tag keeps its counters as IDs and the remembered fast path."""
    source = ScriptedSource()
    d = dispatcher(source)
    d.decode("plain", b'{"count": 2}')
    fast = d.reply_now("plain", b'{"count": 2}')
    assert isinstance(fast, bytes)
    assert ids_of(fast) == [1, 2]


async def test_a_permuted_tag_answers_at_most_max_ids_in_either_format() -> None:
    """A ranges request for a permuted tag is limited like an ids one: each ID is enciphered."""
    d = dispatcher(ScriptedSource(), max_ids=10, max_ranges=1000)
    answer = d.answer_now("order", d.decode("plain", b'{"count": 11, "format": "ranges"}'))
    assert answer is not None
    assert answer.error is not None
    assert answer.error.code == "count_too_large"


@pytest.mark.parametrize("fmt", ["ids", "ranges"])
async def test_a_permuted_tag_answers_at_most_max_permuted_ids(fmt: str) -> None:
    """Past MAX_PERMUTED_IDS (the event loop's and the reply's budget), whatever max_ids says; at it, the IDs."""
    d = dispatcher(ScriptedSource(), max_ids=2 * MAX_PERMUTED_IDS, max_ranges=1_000_000)
    over = d.answer_now(
        "order", d.decode("plain", b'{"count": %d, "format": "%s"}' % (MAX_PERMUTED_IDS + 1, fmt.encode()))
    )
    assert over is not None
    assert over.error is not None
    assert over.error.code == "count_too_large"
    body = b'{"count": %d, "format": "%s"}' % (MAX_PERMUTED_IDS, fmt.encode())
    at = d.answer_now("order", d.decode("order", body))
    assert at is not None
    assert at.error is None
    assert len(set(ids_of(at.body))) == MAX_PERMUTED_IDS


def test_key_files_are_loaded_by_tag_name(tmp_path: Path) -> None:
    """<dir>/<tag>.keys is the tag's; other files are ignored; a missing directory or bad file refuses."""
    (tmp_path / "order.keys").write_text(f"1 {KEY}\n")
    (tmp_path / "README").write_text("not a key file")
    loaded = load_permutations(tmp_path)
    assert list(loaded) == ["order"]
    assert loaded["order"].encode(5) == PERMUTATION.encode(5)
    assert load_permutations(None) == {}
    with pytest.raises(BadRequest, match="not a directory"):
        load_permutations(tmp_path / "missing")
    with pytest.raises(BadRequest, match="no key file"):
        load_permutation(tmp_path, "other")
    (tmp_path / "bad.keys").write_text("1 00\n")
    with pytest.raises(BadRequest, match=r"bad\.keys, line 1"):
        load_permutations(tmp_path)


async def test_a_marked_tag_without_its_key_is_refused_on_every_path_never_plain() -> None:
    """The store marks 'secret' permuted and this worker has no key: unavailable (retryable), no ID."""
    marks = PermutedMarks()
    marks.observe([info("secret", permuted=True)])
    d = Dispatcher(ScriptedSource(), ManualClock(), Limits(), marks=marks)
    body = b'{"count": 2}'
    assert d.reply_now("secret", body) is None
    answers = [
        d.answer_now("secret", d.decode("secret", body)),
        await d.answer("secret", d.decode("secret", body)),
        await d.answer("secret", d.decode("secret", b'{"count": 2, "request_id": "r"}')),
    ]
    for answer in answers:
        assert answer is not None
        assert answer.error is not None
        assert (answer.error.code, answer.error.retryable) == ("unavailable", True)
        assert "no key file" in answer.error.message


async def test_a_tag_remembered_plain_then_marked_leaves_the_fast_path() -> None:
    """Removed and added again as permuted: once the mark is seen, the plain fast path no longer answers it."""
    marks = PermutedMarks()
    d = Dispatcher(ScriptedSource(), ManualClock(), Limits(), marks=marks)
    body = b'{"count": 1}'
    d.decode("order", body)
    assert isinstance(d.reply_now("order", body), bytes)
    marks.observe([info("order", permuted=True)])
    assert d.reply_now("order", body) is None
    answer = d.answer_now("order", d.decode("order", body))
    assert answer is not None
    assert answer.error is not None
    marks.observe([info("order")])  # the mark removed (the tag removed and re-added plain)
    assert marks.tags == set()


async def test_a_new_marked_tag_is_never_answered_plain_even_on_its_first_request() -> None:
    """A tag added permuted while the worker runs: the tag list that teaches the allocator marks it first."""
    store = MemorySegmentStore()
    marks = PermutedMarks()
    clock = SystemClock()  # the allocator's fetch loop waits on its clock: the memory store answers at once
    allocator = SegmentAllocator(MarkingStore(store, marks), clock, AllocatorSettings())
    await allocator.refresh()
    d = Dispatcher(allocator, clock, Limits(), marks=marks)
    await store.add_tag("late", 10, permuted=True)
    answer = await d.answer("late", d.decode("late", b'{"count": 1}'))
    assert answer.error is not None
    assert answer.error.code == "unavailable"
    keyed = Dispatcher(allocator, clock, Limits(), permuted={"late": PERMUTATION}, marks=marks)
    ok = await keyed.answer("late", keyed.decode("late", b'{"count": 1}'))
    assert ok.error is None
    assert ids_of(ok.body)[0] >= SPAN


def info(tag: str, *, permuted: bool = False) -> TagInfo:
    return TagInfo(tag, 1, 10, "", datetime.now(UTC), permuted=permuted)
