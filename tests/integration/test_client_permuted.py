"""The buffered client on a permuted tag, against real workers (NATS, PostgreSQL, a key file).

A permuted tag's IDs come one per range and in no order (docs/permuted.md): the client keeps them as a list,
refilled ahead like a plain tag's ranges, and the plain tag beside it keeps its ranges and its order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from pathlib import Path

import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.cli import main
from dispenser.client import BlockingIdClient, BufferSettings, DispenserUnavailable, IdClient
from dispenser.core.permute import SPAN
from dispenser.service.permuted import load_permutation
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, serving_topics
from .segment_support import client, prepare, running_worker, wait_serving
from .test_permuted import KEY1, config
from .test_permuted_mark import worker as refreshing

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

# Short waits: a client that cannot serve the tag must fail the test in a second, not hang it.
SMALL = BufferSettings(
    min_buffer=20, max_buffer=50, timeout=1.5, request_timeout=1.0, retry_initial=0.01, retry_max=0.1
)


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, list(args))


async def permuted_and_plain(dsn: str, keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tags ``order`` (permuted, its key file in ``keys``) and ``plain``, steps of 50."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "order", "--step", "50", "--permuted") == 0
    assert await cli("tag", "add", "plain", "--step", "50") == 0
    (keys / "order.keys").write_text(f"1 {KEY1}\n")


def assert_permuted(got: list[int], keys: Path) -> None:
    """Distinct IDs of epoch 1, each a distinct counter's."""
    assert len(got) == len(set(got))
    assert all(SPAN <= i < 2 * SPAN for i in got)
    permutation = load_permutation(keys, "order")
    counters = [permutation.decode(i)[1] for i in got]
    assert len(counters) == len(set(counters))


async def test_next_id_and_take_serve_a_permuted_tag_across_refills_and_two_workers(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """next_id and take on a permuted tag: distinct, decodable IDs from both workers; the plain tag unchanged."""
    await permuted_and_plain(pg_dsn, tmp_path, monkeypatch)
    cfg = config(nats_server.url, pg_dsn, tmp_path)
    async with (
        running_worker(cfg) as one,
        running_worker(cfg) as two,
        client(nats_server.url) as nc,
        IdClient.over_nats(nats_server.url, SMALL) as ids,
    ):
        await wait_serving(nc, 2)
        got = [await ids.next_id("order") for _ in range(800)]
        plain = [await ids.next_id("plain") for _ in range(120)]
        got += await ids.take("order", 300)  # more than a refill: several requests
        ranges = await ids.take("order", 40, format="ranges")
        plain += await ids.take("plain", 80)
        got += [await ids.next_id("order") for _ in range(100)]
        stats = ids.stats("order")
        answered = [
            worker.dispatchers["segment"].inline + sum(worker.dispatchers["segment"].waited)
            for worker in (one, two)
        ]
    assert all(first == last for first, last in ranges)  # one range per ID, as the workers answer them
    got += [first for first, _ in ranges]
    assert len(got) == 1240
    assert_permuted(got, tmp_path)
    assert got != sorted(got)
    assert all(a < b for a, b in itertools.pairwise(plain))  # the plain tag: ranges, strictly increasing
    assert plain[0] == 1
    assert stats is not None
    assert stats.requests >= 20  # many refills, each to either worker (all to one: 2**-19)
    assert stats.ids_dropped == 0
    assert stats.ids_handed_out == 1240
    assert all(answered)  # both workers answered the client's refills


async def test_the_blocking_client_serves_a_permuted_tag(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BlockingIdClient.next_id and take on a permuted tag, from two threads: distinct, decodable IDs."""
    await permuted_and_plain(pg_dsn, tmp_path, monkeypatch)
    async with running_worker(config(nats_server.url, pg_dsn, tmp_path)):
        with BlockingIdClient.over_nats(nats_server.url, SMALL) as ids:

            def draw() -> list[int]:
                return [ids.next_id("order") for _ in range(150)] + ids.take("order", 60)

            got = list(itertools.chain(*await asyncio.gather(*(asyncio.to_thread(draw) for _ in range(2)))))
            plain = await asyncio.to_thread(lambda: [ids.next_id("plain") for _ in range(60)])
    assert len(got) == 420
    assert_permuted(got, tmp_path)
    assert plain == list(range(1, 61))


@pytest.mark.kafka
async def test_the_client_over_kafka_serves_a_permuted_tag(
    kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path
) -> None:
    """IdClient.over_kafka on a permuted tag: next_id and take across refills, distinct and decodable IDs."""
    await prepare(pg_dsn, [("plain", 50)])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("order", 50, permuted=True)
    (tmp_path / "order.keys").write_text(f"1 {KEY1}\n")
    cfg = kafka_config(kafka_broker.bootstrap, pg_dsn, **serving_topics(), segment_permute_keys_dir=tmp_path)
    settings = BufferSettings(min_buffer=20, max_buffer=50, request_timeout=20.0, timeout=30.0)
    async with running_worker(cfg), IdClient.over_kafka(cfg.kafka, settings) as ids:
        got = [await ids.next_id("order") for _ in range(200)]
        got += await ids.take("order", 120)
        plain = [await ids.next_id("plain") for _ in range(60)]
        stats = ids.stats("order")
    assert len(got) == 320
    assert_permuted(got, tmp_path)
    assert plain == list(range(1, 61))
    assert stats is not None
    assert stats.requests >= 4  # several refills


async def draw(ids: IdClient, count: int) -> list[int]:
    """``count`` IDs of ``order`` by next_id, asking again after DispenserUnavailable (a worker refusing)."""
    got: list[int] = []
    deadline = time.monotonic() + 10.0
    while len(got) < count:
        try:
            got.append(await ids.next_id("order"))
        except DispenserUnavailable:
            assert time.monotonic() < deadline, "no IDs for 10 s"
            await asyncio.sleep(0.05)  # paces the retries of this caller
    return got


async def test_a_running_client_goes_on_when_its_tag_is_switched_to_permuted(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tag set --permuted` under a client, then a worker with the key file for one without: no ID twice.

    The plain IDs held come first, in order; then permuted IDs, each a counter not drawn before.
    """
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "order", "--step", "50") == 0
    keyless, keyed = tmp_path / "none", tmp_path / "keys"
    keyless.mkdir()
    keyed.mkdir()
    (keyed / "order.keys").write_text(f"1 {KEY1}\n")
    async with contextlib.AsyncExitStack() as stack:
        ids = await stack.enter_async_context(IdClient.over_nats(nats_server.url, SMALL))
        plain_worker = contextlib.AsyncExitStack()
        await plain_worker.enter_async_context(running_worker(refreshing(nats_server.url, pg_dsn, keyless)))
        before = await draw(ids, 100)
        assert await cli("tag", "set", "order", "--permuted") == 0
        await stack.enter_async_context(running_worker(refreshing(nats_server.url, pg_dsn, keyed)))
        await plain_worker.aclose()
        after = await draw(ids, 300)
    assert before == list(range(1, 101))
    got = before + after
    assert len(got) == len(set(got))
    plain = [i for i in got if i < SPAN]
    assert got[: len(plain)] == plain == sorted(plain)  # the plain IDs held first, in order
    permuted = got[len(plain) :]
    assert len(permuted) >= 150
    assert_permuted(permuted, keyed)
    counters = {load_permutation(keyed, "order").decode(i)[1] for i in permuted}
    assert not counters & set(plain)  # the counter went on: none drawn twice
