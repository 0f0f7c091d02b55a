"""The per-worker replay cache: the same (tag, request_id) within the TTL gets the same result."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.core.errors import InvalidRequest, StoreUnavailable
from dispenser.service.dedup import ReplayCache
from dispenser.testing import settle


class Ticker:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_replay_cache_returns_the_same_result_within_ttl() -> None:
    """A key seen within the TTL returns the stored result; after the TTL it is computed afresh."""
    clock = Ticker()
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=clock)
    results = iter(range(100))

    async def compute() -> int:
        return next(results)

    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 0
    clock.now = 59.0
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 0
    clock.now = 61.0
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 1


async def test_replay_cache_shares_a_computation_in_flight() -> None:
    """Two requests with one key at the same time share one computation."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker())
    gate = asyncio.Event()
    calls = 0

    async def compute() -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        return 7

    first = asyncio.ensure_future(cache.get_or_compute(("t", "a"), (1, "ids"), compute))
    second = asyncio.ensure_future(cache.get_or_compute(("t", "a"), (1, "ids"), compute))
    await settle()  # both callers are in: the first computing, the second waiting on it
    assert calls == 1
    gate.set()
    assert list(await asyncio.gather(first, second)) == [7, 7]
    assert calls == 1


async def test_replay_cache_forgets_failures() -> None:
    """A failed computation is not remembered: the retry computes again."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker())

    async def fail() -> int:
        raise StoreUnavailable("down")

    async def succeed() -> int:
        return 3

    with pytest.raises(StoreUnavailable):
        await cache.get_or_compute(("t", "a"), (1, "ids"), fail)
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), succeed) == 3


async def test_replay_cache_refuses_a_request_id_reused_with_other_parameters() -> None:
    """The same key with another count or format is an invalid request, done or in flight."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker())

    async def compute() -> int:
        return 1

    await cache.get_or_compute(("t", "a"), (1, "ids"), compute)
    with pytest.raises(InvalidRequest, match="count 1"):
        await cache.get_or_compute(("t", "a"), (2, "ids"), compute)
    with pytest.raises(InvalidRequest, match="'ids'"):
        await cache.get_or_compute(("t", "a"), (1, "ranges"), compute)


async def test_replay_cache_is_bounded() -> None:
    """Past max_entries the oldest answers are forgotten (a client minting keys cannot grow memory)."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker(), max_entries=3)
    results = iter(range(100))

    async def compute() -> int:
        return next(results)

    for key in "abcd":
        await cache.get_or_compute(("t", key), (1, "ids"), compute)
    assert len(cache) == 3
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 4  # "a" was evicted
