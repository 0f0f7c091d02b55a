"""The buffered client against an in-memory transport: order, sizing, outages, refusals, lost replies, threads."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from dispenser.client import BlockingIdClient, BufferSettings, DispenserUnavailable, IdClient, IdRequestError
from dispenser.client.buffered import next_run
from dispenser.messages import ErrorBody, IdRequest, Kind, Reply
from dispenser.testing import settle
from dispenser.testing.clock import ManualClock

FAST = BufferSettings(retry_initial=0.005, retry_max=0.01, timeout=1.0, request_timeout=0.5)


class MemoryTransport:
    """Grants ranges from counters, one per source (a worker), and replays an answer by ``request_id``.

    ``down`` makes every request fail as if no worker served the subject; ``lose`` drops the next replies
    after the range was granted (as a reply lost on the way back); ``refuse`` answers an error.
    """

    def __init__(self, sources: int = 1, step: int = 1_000_000) -> None:
        # Each source draws from a segment of its own, as two workers do: [1, step], [step + 1, 2 step], ...
        self.positions = [1 + i * step for i in range(sources)]
        self.turn = itertools.cycle(range(sources))
        self.requests: list[IdRequest] = []
        self.answers: dict[str, Reply] = {}
        self.down = False
        self.lose = 0
        self.refuse: ErrorBody | None = None
        self.delay = 0.0

    async def start(self) -> None:
        """Nothing to connect."""

    async def close(self) -> None:
        """Nothing to close."""

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Answer like a fleet: ranges, a replay, or an error."""
        self.requests.append(request)
        await asyncio.sleep(self.delay)
        if self.down:
            raise ConnectionError(f"no dispenser is serving leaf.{kind}.{tag}")
        if self.refuse is not None:
            return Reply(tag=tag, error=self.refuse)
        assert request.request_id is not None
        reply = self.answers.get(request.request_id)
        if reply is None:
            source = next(self.turn)
            first = self.positions[source]
            self.positions[source] += request.count
            reply = Reply(tag=tag, ranges=[(first, first + request.count - 1)], request_id=request.request_id)
            self.answers[request.request_id] = reply
        if self.lose:
            self.lose -= 1
            raise TimeoutError("no reply in time")
        return reply


def ids_held(client: IdClient, tag: str = "order") -> int:
    """The IDs ``client`` holds for ``tag``."""
    stats = client.stats(tag)
    assert stats is not None
    return stats.ids_held


async def drain(client: IdClient, tag: str) -> tuple[list[int], DispenserUnavailable]:
    """Call next_id until it raises DispenserUnavailable: the IDs it gave, and the error."""
    ids: list[int] = []
    while True:
        try:
            ids.append(await client.next_id(tag))
        except DispenserUnavailable as exc:
            return ids, exc


async def test_next_id_and_take_hand_out_increasing_ids_from_few_requests() -> None:
    """next_id and take, mixed, give strictly increasing IDs; a range serves many calls."""
    transport = MemoryTransport()
    async with IdClient(transport, FAST) as client:
        seen: list[int] = []
        for _ in range(2000):
            seen.append(await client.next_id("order"))
            seen += await client.take("order", 7)
            ranges = await client.take("order", 5, format="ranges")
            assert sum(b - a + 1 for a, b in ranges) == 5
            seen += [i for a, b in ranges for i in range(a, b + 1)]
        stats = client.stats("order")
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert len(seen) == 2000 * 13
    assert stats is not None
    assert stats.ids_handed_out == len(seen)
    assert stats.requests < 20
    assert all(r.format == "ranges" and r.request_id for r in transport.requests)


async def test_ranges_follow_the_rate_within_bounds() -> None:
    """Ranges start at min_buffer and grow with the consumption, never past max_buffer."""
    transport = MemoryTransport()
    settings = BufferSettings(min_buffer=50, max_buffer=20_000, buffer_seconds=1.0)
    async with IdClient(transport, settings) as client:
        for _ in range(200_000):
            await client.next_id("order")
    counts = [r.count for r in transport.requests]
    assert counts[0] == 50
    assert max(counts) == 20_000
    assert all(50 <= c <= 20_000 for c in counts)


async def test_an_outage_serves_what_is_held_then_raises_and_recovers() -> None:
    """No worker: the held IDs are handed out, then DispenserUnavailable (retryable); then it recovers.

    On virtual time: the call during the outage raises without waiting a moment, and the background refill
    gets through by itself within its back-off (0.01 s at most, 20 % jitter).
    """
    clock = ManualClock()
    transport = MemoryTransport()
    settings = BufferSettings(min_buffer=100, max_buffer=100, retry_initial=0.005, retry_max=0.01)
    async with IdClient(transport, settings, clock=clock) as client:
        first = await client.next_id("order")
        await settle()  # the refill set off by the first call has run: the second range is held
        assert ids_held(client) == 199
        transport.down = True
        held, error = await drain(client, "order")
        served = [first, *held]
        assert error.retryable
        assert error.code == "unreachable"
        assert len(served) == 200  # both ranges, then the error
        call = asyncio.ensure_future(client.next_id("order"))
        await settle()
        assert call.done()  # at once while the outage lasts: no virtual time passed
        with pytest.raises(DispenserUnavailable):
            await call
        transport.down = False
        await clock.advance(0.012)  # the background refill gets through by itself
        assert ids_held(client) == 100
        after = await client.next_id("order")
    assert after > served[-1]


async def test_a_refusal_is_raised_once_per_call_not_retried() -> None:
    """An unknown tag: the coded error, one request per call, no retries in the background (5 virtual s each)."""
    clock = ManualClock()
    transport = MemoryTransport()
    transport.refuse = ErrorBody("unknown_tag", "unknown tag 'nope'", retryable=False)
    async with IdClient(transport, FAST, clock=clock) as client:
        for attempt in range(1, 4):
            with pytest.raises(IdRequestError) as caught:
                await client.next_id("nope")
            assert not isinstance(caught.value, DispenserUnavailable)
            assert caught.value.code == "unknown_tag"
            assert not caught.value.retryable
            await clock.advance(5.0)
            assert len(transport.requests) == attempt
        waiters = await asyncio.gather(*(client.next_id("nope") for _ in range(50)), return_exceptions=True)
        assert all(isinstance(w, IdRequestError) for w in waiters)
        assert len(transport.requests) == 4  # fifty callers, one request


async def test_a_lost_reply_is_asked_again_with_the_same_request_id() -> None:
    """The retry of a refill whose reply was lost carries its request_id: the same range, nothing skipped."""
    transport = MemoryTransport()
    transport.lose = 2
    async with IdClient(transport, FAST) as client:
        ids = await client.take("order", 10)
    assert [r.request_id for r in transport.requests[:3]] == [transport.requests[0].request_id] * 3
    assert ids == list(range(1, 11))


async def test_ranges_below_what_is_held_are_dropped() -> None:
    """Two workers on two segments: what the one behind grants is skipped; the IDs still increase."""
    transport = MemoryTransport(sources=2, step=10_000)
    settings = BufferSettings(min_buffer=100, max_buffer=100)
    async with IdClient(transport, settings) as client:
        seen = [await client.next_id("order") for _ in range(5_000)]
        stats = client.stats("order")
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert stats is not None
    assert stats.ids_dropped > 0
    assert stats.ids_handed_out == len(seen)


async def test_snowflake_ids_are_one_request_each() -> None:
    """kind="snowflake" is not buffered: every call is a request."""
    transport = MemoryTransport()
    async with IdClient(transport, FAST) as client:
        one = await client.next_id("events", kind="snowflake")
        more = await client.take("events", 3, kind="snowflake")
    assert one < more[0]
    assert [r.count for r in transport.requests] == [1, 3]


@pytest.mark.parametrize("tag", ["bad tag!", "", "x" * 129, "a>b", "a*"])
async def test_a_bad_tag_name_is_refused_before_any_request(tag: str) -> None:
    """Issue 24 item 7: the coded ``invalid_tag`` at once, as a worker would answer; nothing sent or retried."""
    transport = MemoryTransport()
    async with IdClient(transport, FAST) as client:
        for call in (client.next_id(tag), client.take(tag, 2), client.next_id(tag, kind="snowflake")):
            with pytest.raises(IdRequestError) as caught:
                await call
            assert caught.value.code == "invalid_tag"
            assert not caught.value.retryable
            assert not isinstance(caught.value, DispenserUnavailable)
        assert transport.requests == []
        assert client.stats(tag) is None
    with BlockingIdClient(transport, FAST) as blocking, pytest.raises(IdRequestError) as caught:
        blocking.next_id(tag)
    assert caught.value.code == "invalid_tag"
    assert transport.requests == []


def test_the_blocking_client_from_sixteen_threads() -> None:
    """Sixteen threads share one blocking client: every ID once, increasing within each thread."""
    transport = MemoryTransport()
    transport.delay = 0.0005
    per_thread: list[list[int]] = [[] for _ in range(16)]
    with BlockingIdClient(transport, FAST) as client:

        def work(out: list[int]) -> None:
            for n in range(3000):
                if n % 100 == 0:
                    out.extend(client.take("order", 10))
                else:
                    out.append(client.next_id("order"))

        threads = [threading.Thread(target=work, args=(out,)) for out in per_thread]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    everything = [i for out in per_thread for i in out]
    assert len(everything) == len(set(everything)) == 16 * (2970 + 300)
    for out in per_thread:
        assert all(a < b for a, b in itertools.pairwise(out))


async def test_a_counter_gone_back_is_skipped_with_a_pause_not_a_spin() -> None:
    """The tag's counter set back below what the client held: those ranges are skipped, the IDs still increase."""
    transport = MemoryTransport()
    settings = BufferSettings(min_buffer=100, max_buffer=100, retry_initial=0.005, retry_max=0.01)
    async with IdClient(transport, settings) as client:
        seen = [await client.next_id("order")]
        await settle()  # the refill set off by the first call has run: 2..200 held
        assert ids_held(client) == 199
        transport.positions[0] = 1  # someone reset the counter
        seen += [await client.next_id("order") for _ in range(200)]
        stats = client.stats("order")
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert seen[-1] > 200
    assert stats is not None
    assert stats.ids_dropped >= 200


async def test_a_source_far_behind_is_passed_in_one_request_not_range_by_range() -> None:
    """Ranges far below what is held: the next request asks for the whole gap at once (issue 23's frozen datacenter).

    A worker behind by 50,000 IDs, asked range by range for the client's 100, would take 500 requests to catch
    up; the client asks for enough to pass what it holds instead (the IDs skipped are gaps, never repeats).
    """
    transport = MemoryTransport()
    settings = BufferSettings(min_buffer=100, max_buffer=100, retry_initial=0.005, retry_max=0.01)
    async with IdClient(transport, settings) as client:
        seen = await client.take("order", 50_000)
        await settle()
        transport.positions[0] = 1  # every worker now answers from far below what the client holds
        before = len(transport.requests)
        seen += [await client.next_id("order") for _ in range(300)]
        after = len(transport.requests)
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert after - before <= 6, f"{after - before} requests to pass a gap of 50,000 IDs"


def test_a_cursor_run_doubles_when_quick_halves_when_slow_and_stays_bounded() -> None:
    assert next_run(8, 0.0005) == 16
    assert next_run(8, 0.005) == 8
    assert next_run(8, 0.5) == 4
    assert next_run(4096, 0.0) == 4096
    assert next_run(1, 10.0) == 1
    assert next_run(8, 0.0015, fast=0.002, slow=0.05) == 16  # the blocking client's thresholds
    assert next_run(8, 0.03, fast=0.002, slow=0.05) == 8


class SilentTransport(MemoryTransport):
    """A fleet that never answers: a request waits until the test opens ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Wait for the gate, then answer as the memory fleet does."""
        await self.gate.wait()
        return await super().request(kind, tag, request, timeout)


async def test_on_virtual_time_the_wait_ends_at_timeout_to_the_millisecond() -> None:
    """The client's waits are its Clock's: with no answer, a call fails at ``timeout`` of virtual time."""
    clock = ManualClock()
    transport = SilentTransport()
    async with IdClient(transport, BufferSettings(timeout=2.0), clock=clock) as client:
        call = asyncio.ensure_future(client.next_id("order"))
        await clock.advance(1.999)
        assert not call.done()
        await clock.advance(0.002)
        with pytest.raises(DispenserUnavailable, match="within 2 s") as caught:
            await call
        assert caught.value.code == "timeout"
        transport.gate.set()


async def test_on_virtual_time_ranges_hold_buffer_seconds_of_the_rate() -> None:
    """10,000 IDs per virtual second: the ranges settle at about buffer_seconds x the rate (3 s: ~30,000)."""
    clock = ManualClock()
    transport = MemoryTransport()
    settings = BufferSettings(min_buffer=100, max_buffer=1_000_000, buffer_seconds=3.0)
    async with IdClient(transport, settings, clock=clock) as client:
        for _ in range(500):  # 5 virtual seconds
            for _ in range(100):
                await client.next_id("order")
            await clock.advance(0.01)
    counts = [r.count for r in transport.requests]
    assert counts[0] == 100
    assert 30_000 <= counts[-1] <= 30_000 * 1.25  # never under the target, within the hysteresis band
    assert len(counts) < 20


async def test_on_virtual_time_interleaving_workers_hold_no_more_than_buffer_seconds() -> None:
    """Issue 30: two workers whose segments interleave; the client holds about its buffer, not the gap.

    A reply below the IDs held used to make the next request ask for the whole gap on top of the range; the
    worker ahead answered it and the client held the gap (a million IDs here, 50 s at 20,000 IDs/s). Now
    at most two ranges of ``buffer_seconds`` x the rate (with the policy's 25 % hysteresis) and a cursor run.
    """
    clock = ManualClock()
    transport = MemoryTransport(sources=2, step=1_000_000)  # the workers' segments: 1.., 1,000,001..
    settings = BufferSettings(
        min_buffer=100, max_buffer=1_000_000, buffer_seconds=1.0, retry_initial=0.005, retry_max=0.01
    )
    rate = 20_000
    bound = 2 * 1.25 * settings.buffer_seconds * rate + 4096
    async with IdClient(transport, settings, clock=clock) as client:
        for _ in range(300):  # 3 virtual seconds at 20,000 IDs/s
            for _ in range(rate // 100):
                await client.next_id("order")
            await clock.advance(0.01)
            assert ids_held(client) <= bound
        stats = client.stats("order")
        assert stats is not None
        assert stats.ids_dropped > 0  # the workers did interleave
        transport.down = True  # the workers stop: what the client hands out is what it held
        held, error = await drain(client, "order")
    assert error.code == "unreachable"
    assert len(held) <= bound
