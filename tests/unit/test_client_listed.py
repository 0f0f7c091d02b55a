"""The buffered client on a permuted tag, against an in-memory fleet: a list refilled ahead, requests at once."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispenser.client import BlockingIdClient, BufferSettings, DispenserUnavailable, IdClient
from dispenser.client.listed import FIRST_POSITION, PERMUTED_REQUEST_MAX, REQUESTS_IN_FLIGHT, Listed
from dispenser.messages import ErrorBody, IdRequest, Kind, Reply
from dispenser.service.dispatch import MAX_PERMUTED_IDS
from dispenser.testing import settle
from dispenser.testing.clock import ManualClock

SPAN = 10**18
MULTIPLIER = 123_456_789_012_345_677  # odd, not a multiple of 5: n -> n * M mod 10**18 is a bijection
INVERSE = pow(MULTIPLIER, -1, SPAN)
FAST = BufferSettings(retry_initial=0.005, retry_max=0.01, timeout=1.0, request_timeout=0.5)


def counter_of(permuted_id: int) -> int:
    """The counter the fleet below enciphered into ``permuted_id``."""
    return (permuted_id - SPAN) * INVERSE % SPAN


class PermutedFleet:
    """Answers like workers serving a permuted tag: a list, or one ``[id, id]`` range per ID; ``permuted: true``.

    At most :data:`MAX_PERMUTED_IDS` a request (``count_too_large`` past it, as a worker answers); a
    ``request_id`` is answered its first IDs again. ``lose`` drops the next replies after the IDs were
    drawn (those of a request without a ``request_id`` kept in ``lost``); ``plain`` answers plain ranges instead (the tag removed and added again); ``delay`` holds each
    reply, so that requests sent together are in flight together (``most_in_flight``).
    """

    def __init__(self) -> None:
        self.counter = 1
        self.requests: list[IdRequest] = []
        self.answers: dict[str, Reply] = {}
        self.lose = 0
        self.lost: list[int] = []
        self.plain = False
        self.delay = 0.0
        self.in_flight = 0
        self.most_in_flight = 0

    async def start(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to close."""

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Answer the request: permuted IDs, a replay, or ``count_too_large``."""
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        rid = request.request_id
        reply = None if rid is None else self.answers.get(rid)
        if reply is None:
            first, self.counter = self.counter, self.counter + request.count
            if self.plain:
                ids = list(range(first, self.counter))
                ranges = [(first, self.counter - 1)]
            elif request.count > MAX_PERMUTED_IDS:
                error = ErrorBody("count_too_large", f"count {request.count} is over the limit", False)
                return Reply(tag=tag, error=error)
            else:
                ids = [SPAN + n * MULTIPLIER % SPAN for n in range(first, self.counter)]
                ranges = [(i, i) for i in ids]
            permuted = not self.plain
            if request.format == "ids":
                reply = Reply(tag=tag, ids=ids, request_id=rid, permuted=permuted)
            else:
                reply = Reply(tag=tag, ranges=ranges, request_id=rid, permuted=permuted)
            if rid is not None:
                self.answers[rid] = reply
        if self.lose:
            self.lose -= 1
            if rid is None:  # with a request_id, a retry gets these IDs again
                self.lost += reply.ids or [a for a, _ in reply.ranges or ()]
            raise TimeoutError("no reply in time")
        return reply


def ids_held(client: IdClient) -> int:
    """The IDs of ``order`` the client holds."""
    stats = client.stats("order")
    assert stats is not None
    return stats.ids_held


def assert_distinct_counters(ids: list[int]) -> None:
    """Distinct IDs of the permuted range, each a distinct counter's."""
    assert len(ids) == len(set(ids))
    assert all(SPAN <= i < 2 * SPAN for i in ids)
    assert len({counter_of(i) for i in ids}) == len(ids)


def test_the_clients_request_limit_is_the_workers() -> None:
    """The client asks a permuted tag for no more IDs a request than a worker answers."""
    assert PERMUTED_REQUEST_MAX == MAX_PERMUTED_IDS


async def test_next_id_and_take_serve_a_permuted_tag_refilled_ahead() -> None:
    """Distinct IDs, every counter once; the next refill is asked for while IDs are still held."""
    fleet = PermutedFleet()
    async with IdClient(fleet, FAST) as client:
        got = [await client.next_id("order")]
        await settle()  # the refill started by the first range's use
        stats = client.stats("order")
        assert stats is not None
        assert stats.ids_held > 0
        assert len(fleet.requests) == 2  # ahead: the next range before this one ran out
        for _ in range(300):
            got.append(await client.next_id("order"))
            got += await client.take("order", 7)
            ranges = await client.take("order", 3, format="ranges")
            assert all(a == b for a, b in ranges)
            got += [a for a, _ in ranges]
            await asyncio.sleep(0)  # as a service awaiting its own I/O: the refill runs
        stats = client.stats("order")
    assert len(got) == 1 + 300 * 11
    assert_distinct_counters(got)
    assert got != sorted(got)
    assert stats is not None
    assert (stats.ids_dropped, stats.ids_handed_out) == (0, len(got))
    assert all(r.count <= MAX_PERMUTED_IDS for r in fleet.requests)
    assert [r.format for r in fleet.requests[:2]] == [
        "ranges",
        "ids",
    ]  # a list once the tag is known permuted


async def test_a_large_take_is_several_requests_in_flight_at_once() -> None:
    """A take of 5 requests' worth: the first asks the most (the tag's kind unknown yet), the rest 4 at once."""
    fleet = PermutedFleet()
    fleet.delay = 0.01
    async with IdClient(fleet, FAST) as client:
        got = await client.take("order", 5 * MAX_PERMUTED_IDS)
    assert len(got) == 5 * MAX_PERMUTED_IDS
    assert_distinct_counters(got)
    assert [r.count for r in fleet.requests[:5]] == [MAX_PERMUTED_IDS] * 5
    assert fleet.most_in_flight >= 4
    assert REQUESTS_IN_FLIGHT >= 4


async def test_a_lost_reply_is_asked_again_alone_and_its_ids_are_a_gap() -> None:
    """One of a refill's 3 requests loses its reply: only it is sent again; its IDs are never handed out."""
    fleet = PermutedFleet()
    async with IdClient(fleet, FAST) as client:
        got = await client.take("order", 10)  # the tag is known permuted from here
        sent_before = len(fleet.requests)
        held = ids_held(client)
        fleet.lose = 1
        got += await client.take("order", 3 * MAX_PERMUTED_IDS)
    assert_distinct_counters(got)
    assert len(got) == 10 + 3 * MAX_PERMUTED_IDS
    assert fleet.lost
    assert not set(fleet.lost) & set(got)
    refills = fleet.requests[sent_before:]
    assert all(r.request_id is None and r.format == "ids" for r in refills)  # no replay record to write
    assert sum(r.count for r in refills) >= 3 * MAX_PERMUTED_IDS - held + len(
        fleet.lost
    )  # the lost one again


@pytest.mark.parametrize("first_plain", [True, False])
async def test_a_tag_switched_between_plain_and_permuted_is_served_on(first_plain: bool) -> None:
    """`tag set --permuted` (or `--no-permuted`) under a client: the IDs held are handed out, then the others'.

    Plain then permuted: the plain ranges held come first (in order), then the permuted IDs. Permuted then
    plain: the tag stays a list in this client, its plain IDs kept in it. No ID twice, no error.
    """
    fleet = PermutedFleet()
    fleet.plain = first_plain
    settings = BufferSettings(min_buffer=100, max_buffer=100, timeout=1.0, retry_initial=0.005)
    clock = ManualClock()
    async with IdClient(fleet, settings, clock) as client:

        async def slowly(n: int) -> list[int]:
            # 30 ms a call: the cursor's runs stay at one ID, so the buffer holds the rest of each range.
            got = []
            for _ in range(n):
                got.append(await client.next_id("order"))
                await clock.advance(0.03)
            return got

        before = await slowly(3)
        drawn = fleet.counter - 1  # counters drawn before the switch: the range in use and the next
        fleet.plain = not first_plain
        after = await slowly(400)
        after += await client.take("order", 50)
        stats = client.stats("order")
    got = before + after
    assert len(got) == len(set(got)) == 453
    plain = [i for i in got if i < SPAN]
    permuted = [i for i in got if i >= SPAN]
    assert plain
    assert permuted
    assert len(set(map(counter_of, permuted)) | set(plain)) == len(got)  # every counter once
    if first_plain:  # the plain IDs held come first, in order, all of them: none lost to the switch
        assert got[: len(plain)] == plain == list(range(1, drawn + 1))
    assert stats is not None
    assert stats.ids_handed_out == 453


async def test_a_busy_client_of_a_tag_switched_to_permuted_goes_on() -> None:
    """Refills of 20,000, then `tag set --permuted`: the refused 20,000 is asked again as 10,000, then a list."""
    fleet = PermutedFleet()
    fleet.plain = True
    n = MAX_PERMUTED_IDS
    settings = BufferSettings(min_buffer=2 * n, max_buffer=2 * n, timeout=1.0, retry_initial=0.005)
    async with IdClient(fleet, settings) as client:
        before = await client.take("order", 3 * n)
        await settle()  # the next refill of 20,000 in
        fleet.plain = False
        switched = len(fleet.requests)
        after = await client.take("order", 5 * n)
        after += [await client.next_id("order") for _ in range(n)]
    assert before == list(range(1, 3 * n + 1))
    got = before + after
    assert len(got) == len(set(got)) == 9 * n
    permuted = [i for i in got if i >= SPAN]
    assert len(permuted) >= 3 * n  # after the plain IDs held (up to two ranges of 20,000)
    assert len({counter_of(i) for i in permuted} | {i for i in got if i < SPAN}) == len(got)
    assert fleet.requests[switched].count > n  # refused (count_too_large), then asked as 10,000
    assert fleet.requests[switched + 1].count == n


async def test_a_plain_tags_first_request_is_capped_then_its_ranges_are_not() -> None:
    """A plain tag's first take of 5 requests' worth costs one request more (the most, then the rest)."""
    fleet = PermutedFleet()
    fleet.plain = True
    n = MAX_PERMUTED_IDS
    async with IdClient(fleet, FAST) as client:
        got = await client.take("order", 5 * n, format="ranges")
        more = await client.take("order", 20 * n)
    assert got == [(1, 5 * n)]
    assert more == list(range(5 * n + 1, 25 * n + 1))
    assert [r.count for r in fleet.requests[:2]] == [n, 4 * n]


async def test_take_run_gives_one_permuted_id_a_call() -> None:
    """take_run's range is one ID of a permuted tag; take_block a list of up to its limit."""
    fleet = PermutedFleet()
    async with IdClient(fleet, FAST) as client:
        run = await client.take_run("order", 50)
        block = await client.take_block("order", 50)
    assert run[0] == run[1]
    assert isinstance(block, list)
    assert 1 <= len(block) <= 50
    assert_distinct_counters([run[0], *block])


async def test_the_blocking_client_serves_a_permuted_tag_from_threads() -> None:
    """BlockingIdClient.next_id and take on a permuted tag from 4 threads: no ID twice."""
    fleet = PermutedFleet()

    def draw(client: BlockingIdClient) -> list[int]:
        got = []
        for _ in range(200):
            got.append(client.next_id("order"))
            got += client.take("order", 3)
        return got

    with BlockingIdClient(fleet, FAST) as client:
        drawn = await asyncio.gather(*(asyncio.to_thread(draw, client) for _ in range(4)))
    got = list(itertools.chain(*drawn))
    assert len(got) == 4 * 200 * 4
    assert_distinct_counters(got)


@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 60)), min_size=1, max_size=30))
def test_listed_hands_out_each_id_once_in_the_order_it_arrived(steps: list[tuple[int, int]]) -> None:
    """Positions handed out in increasing runs give the IDs added, in order, each once."""
    listed = Listed()
    added: list[int] = []
    out: list[int] = []
    position = FIRST_POSITION  # above every ID: a plain tag's ranges held stay below
    for n, take in steps:
        first, last = listed.add(list(range(len(added), len(added) + n)))
        assert (first, last) == (FIRST_POSITION + len(added), FIRST_POSITION + len(added) + n - 1)
        added += range(len(added), len(added) + n)
        end = min(position + take - 1, last)
        out += listed.ids(position, end)
        position = end + 1
    assert out == added[: position - FIRST_POSITION]


calls = st.lists(
    st.tuples(
        st.sampled_from(["next_id", "take", "take_ranges", "take_block", "lose", "switch", "settle"]),
        st.integers(1, 300),
    ),
    min_size=1,
    max_size=25,
)


@settings(deadline=None, max_examples=100)
@given(ops=calls, min_buffer=st.integers(1, 60), first_plain=st.booleans())
def test_no_id_twice_whatever_the_calls_and_the_fleet_do(
    ops: list[tuple[str, int]], min_buffer: int, first_plain: bool
) -> None:
    """next_id, take and take_block mixed, replies lost, the tag switched either way: no ID, no counter twice."""
    asyncio.run(_drive(ops, min_buffer, first_plain))


async def _drive(ops: list[tuple[str, int]], min_buffer: int, first_plain: bool) -> None:
    fleet = PermutedFleet()
    fleet.plain = first_plain
    quick = BufferSettings(
        min_buffer=min_buffer,
        max_buffer=max(min_buffer, 200),
        timeout=1.0,
        retry_initial=0.001,
        retry_max=0.002,
    )
    got: list[int] = []
    async with IdClient(fleet, quick) as client:
        for op, n in ops:
            try:
                if op == "next_id":
                    for _ in range(n):
                        got.append(await client.next_id("order"))
                elif op == "take":
                    got += await client.take("order", n)
                elif op == "take_ranges":
                    got += [
                        i for a, b in await client.take("order", n, format="ranges") for i in range(a, b + 1)
                    ]
                elif op == "take_block":
                    got += await client.take_block("order", n)
                elif op == "lose":
                    fleet.lose = 1 + n % 3
                elif op == "switch":
                    fleet.plain = not fleet.plain
                else:
                    await settle()
            except DispenserUnavailable:  # a lost reply: a call finding the buffer empty meanwhile is told so
                await asyncio.sleep(0.003)
    assert len(got) == len(set(got))
    counters = [counter_of(i) if i >= SPAN else i for i in got]  # a plain ID is its counter
    assert len(counters) == len(set(counters))
    assert not set(fleet.lost) & set(got)
