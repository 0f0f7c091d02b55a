"""The ReplayStore contract, written once and run against the in-memory fake and the Postgres adapter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from dispenser.adapters.postgres.replay import PostgresReplayStore
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.ports import ReplayStore, Settled
from dispenser.testing.fakes import MemoryReplayStore

KEY = ("segment", "order", "r-1")
OURS = ((1, 10),)
THEIRS = ((11, 15), (40, 44))


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[list[ReplayStore]]:
    """Two handles on one implementation's store (two workers): the fake, or two pools on one database."""
    if request.param == "memory":
        memory = MemoryReplayStore(time.monotonic)
        yield [memory, memory]
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    await migrate(dsn)
    pools = [await PostgresSegmentStore.connect(dsn, max_size=8) for _ in range(2)]
    yield [PostgresReplayStore(pool) for pool in pools]
    for pool in pools:
        await pool.close()


async def test_the_first_answer_is_recorded_and_returned(stores: list[ReplayStore]) -> None:
    """Nothing held: our answer is recorded and comes back."""
    assert await stores[0].settle(KEY, 10, "ids", OURS, 60) == Settled(10, "ids", OURS)


async def test_a_later_answer_gets_the_first_one(stores: list[ReplayStore]) -> None:
    """A second worker settling the same key gets the first answer back, its own is dropped."""
    first = await stores[0].settle(KEY, 10, "ranges", THEIRS, 60)
    second = await stores[1].settle(KEY, 10, "ranges", OURS, 60)
    assert second == first == Settled(10, "ranges", THEIRS)


async def test_keys_differ_by_kind_tag_and_request_id(stores: list[ReplayStore]) -> None:
    """Each part of the key separates answers."""
    await stores[0].settle(KEY, 10, "ids", OURS, 60)
    for key in [("snowflake", "order", "r-1"), ("segment", "other", "r-1"), ("segment", "order", "r-2")]:
        assert await stores[1].settle(key, 5, "ids", THEIRS, 60) == Settled(5, "ids", THEIRS)


async def test_the_held_answer_keeps_its_own_count_and_format(stores: list[ReplayStore]) -> None:
    """A retry that changed its count or format learns what the key was used with (the caller refuses it)."""
    await stores[0].settle(KEY, 10, "ids", OURS, 60)
    assert await stores[1].settle(KEY, 3, "ranges", THEIRS, 60) == Settled(10, "ids", OURS)


async def test_an_expired_answer_is_replaced(stores: list[ReplayStore]) -> None:
    """Past its TTL (0 here: expired at once), a key is free again and takes the new answer."""
    await stores[0].settle(KEY, 10, "ids", OURS, 0)
    assert await stores[1].settle(KEY, 5, "ranges", THEIRS, 60) == Settled(5, "ranges", THEIRS)


async def test_sweep_deletes_only_expired_answers(stores: list[ReplayStore]) -> None:
    """Expired answers go, live ones stay."""
    await stores[0].settle(("segment", "order", "old"), 10, "ids", OURS, 0)
    await stores[0].settle(KEY, 10, "ids", OURS, 60)
    assert await stores[1].sweep() == 1
    assert await stores[1].sweep() == 0
    assert await stores[1].settle(KEY, 5, "ids", THEIRS, 60) == Settled(10, "ids", OURS)


async def test_racing_answers_settle_on_one(stores: list[ReplayStore]) -> None:
    """Sixteen concurrent settles of one key from two handles, each with its own IDs: all get the same."""
    answers = [((n * 100, n * 100 + 9),) for n in range(1, 17)]
    settled = await asyncio.gather(
        *(stores[n % 2].settle(KEY, 10, "ids", ranges, 60) for n, ranges in enumerate(answers))
    )
    assert len(set(settled)) == 1
    assert settled[0].ranges in answers


async def test_a_large_answer_round_trips(stores: list[ReplayStore]) -> None:
    """Many ranges and 63-bit IDs come back exactly."""
    ranges = tuple((2**62 + 10 * n, 2**62 + 10 * n + 4) for n in range(2_000))
    assert (await stores[0].settle(KEY, 10_000, "ranges", ranges, 60)).ranges == ranges
    assert (await stores[1].settle(KEY, 10_000, "ranges", OURS, 60)).ranges == ranges


async def test_many_keys_from_two_handles_in_opposite_orders_settle_one_answer_each(
    stores: list[ReplayStore],
) -> None:
    """300 keys raced by two handles, one in order and one reversed (the Postgres one batches them).

    Batches of two workers that share keys lock them in key order, so they cannot deadlock; copies of one
    key in one handle's queue share one row.
    """
    keys = [("segment", "order", f"r-{n}") for n in range(300)]

    async def settle_all(store: ReplayStore, order: list[tuple[str, str, str]], base: int) -> list[Settled]:
        return list(
            await asyncio.gather(
                *(store.settle(key, 1, "ids", ((base + int(key[2][2:]),) * 2,), 60) for key in order)
            )
        )

    first, second = await asyncio.gather(
        settle_all(stores[0], keys, 1_000), settle_all(stores[1], keys[::-1], 5_000)
    )
    assert first == second[::-1]
    for n, settled in enumerate(first):
        assert settled.ranges in (((1_000 + n, 1_000 + n),), ((5_000 + n, 5_000 + n),))
