"""``dispenser enrich`` against a real broker: exactly once through crashes and rebalances, bad records to the DLQ."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispenser.adapters.kafka.enrich import (
    ERROR_CODE_HEADER,
    SOURCE_HEADER,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    Enricher,
    EnrichSettings,
)
from dispenser.adapters.prometheus import EnricherCollector
from dispenser.service.enrichment import Placement
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import (
    EnricherProcess,
    Header,
    Record,
    TopicReader,
    create_topics,
    enriching,
    input_producer,
    kafka_config,
    kafka_env,
    produce,
    send_all,
    unique,
)
from .segment_support import prepare, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

PARTITIONS = 4
BAD_VALUES = (b"not json at all", b'{"n": -1, "order": 5}', b'{"n": -2}')
"""Planted bad records: not JSON, ``order`` not an object, ``order`` missing."""


def record_for(i: int, bad_every: int) -> tuple[int, bytes, bytes, list[Header]]:
    """Input record ``i``: partition ``i % 4``, a key and a header to pass through; some unfit.

    Every ``bad_every``-th record cannot take ``--field order.id``.
    """
    if bad_every and i % bad_every == bad_every - 1:
        value = BAD_VALUES[(i // bad_every) % len(BAD_VALUES)]
    else:
        value = json.dumps({"n": i, "order": {"sku": f"s{i}"}}).encode()
    return i % PARTITIONS, f"k{i}".encode(), value, [("trace", str(i).encode())]


TIMESTAMP_BASE = int(time.time() * 1000) - 3_600_000
"""Input records are an hour old (within any retention), one millisecond apart: their own event times."""


def timestamp_of(i: int) -> int:
    """Input record ``i``'s timestamp, which its output (or dead letter) must keep."""
    return TIMESTAMP_BASE + i


def _nth(first: int, i: int) -> int:
    """The timestamp of the ``i``-th record of a batch that starts with record ``first``."""
    return timestamp_of(first + i)


def source_of(record: Record) -> tuple[int, int]:
    """The input ``(partition, offset)`` an output or dead letter came from (its ``leaf-source`` header)."""
    raw = record.header(SOURCE_HEADER)
    assert raw is not None
    _topic, partition, offset = raw.decode().rsplit("/", 2)
    return int(partition), int(offset)


async def make_stream(
    bootstrap: str, count: int, bad_every: int
) -> tuple[str, str, dict[tuple[int, int], int]]:
    """An input topic with ``count`` records; returns (input, output, (partition, offset) → record number)."""
    topic_in, topic_out = unique("orders.raw"), unique("orders.enriched")
    # All three up front, so that readers can start before the enricher (which would create the other two).
    await create_topics(
        bootstrap, {topic_in: PARTITIONS, topic_out: PARTITIONS, f"{topic_in}.dlq": PARTITIONS}
    )
    placed = await produce(
        bootstrap, topic_in, (record_for(i, bad_every) for i in range(count)), timestamp_ms=timestamp_of
    )
    return topic_in, topic_out, {where: i for i, where in enumerate(placed)}


def check_exactly_once(
    outputs: list[Record], dead: list[Record], where: dict[tuple[int, int], int], bad_every: int
) -> None:
    """One output per good input, one dead letter per bad one; unique IDs; order kept; pass-through intact."""
    bad = {src for src, i in where.items() if bad_every and i % bad_every == bad_every - 1}
    good = set(where) - bad
    out_sources = Counter(source_of(r) for r in outputs)
    duplicated = [s for s, n in out_sources.items() if n > 1]
    assert not duplicated, f"{len(duplicated)} inputs enriched more than once, e.g. {duplicated[:5]}"
    assert set(out_sources) == good, (len(set(out_sources) - good), len(good - set(out_sources)))
    dead_sources = Counter(source_of(r) for r in dead)
    assert all(n == 1 for n in dead_sources.values())
    assert set(dead_sources) == bad
    ids = []
    for record in outputs:
        document = json.loads(record.value or b"")
        i = where[source_of(record)]
        assert document["n"] == i
        assert record.key == f"k{i}".encode()
        assert record.header("trace") == str(i).encode()
        assert record.timestamp == timestamp_of(i), "an output keeps its input's timestamp"
        ids.append(document["order"]["id"])
    assert len(set(ids)) == len(ids), f"{len(ids) - len(set(ids))} IDs handed out twice"
    for partition in range(PARTITIONS):  # input partition p -> output partition p, in input order
        offsets = [source_of(r)[1] for r in outputs if r.partition == partition]
        assert all(source_of(r)[0] == partition for r in outputs if r.partition == partition)
        assert offsets == sorted(offsets)
    for record in dead:
        partition, offset = source_of(record)
        assert record.header(SOURCE_PARTITION_HEADER) == str(partition).encode()
        assert record.header(SOURCE_OFFSET_HEADER) == str(offset).encode()
        assert record.header(ERROR_CODE_HEADER) in (b"not_json", b"not_an_object", b"field_missing")
        assert record.value in BAD_VALUES
        assert record.timestamp == timestamp_of(where[(partition, offset)])


def enriching_order(
    bootstrap: str, pg_dsn: str, topic_in: str, topic_out: str, commit_records: int
) -> contextlib.AbstractAsyncContextManager[tuple[Enricher, asyncio.Task[None]]]:
    """:func:`enriching` ``topic_in`` into ``topic_out`` (tag ``order``, field ``order.id``)."""
    settings = EnrichSettings(
        input_topic=topic_in,
        output_topic=topic_out,
        tag="order",
        placement=Placement.from_options(field="order.id"),
        group_id=unique("enrich"),
        commit_records=commit_records,
    )
    return enriching(kafka_config(bootstrap, pg_dsn), settings)


async def test_in_process_enrichment_with_bad_records(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """2,000 records, every 50th unfit: outputs and dead letters exactly once, keys and headers kept."""
    await prepare(pg_dsn, [("order", 500)])
    bootstrap = kafka_broker.bootstrap
    topic_in, topic_out, where = await make_stream(bootstrap, 2000, bad_every=50)
    async with (
        enriching_order(bootstrap, pg_dsn, topic_in, topic_out, commit_records=300) as (enricher, _),
        TopicReader(bootstrap, topic_out) as out,
        TopicReader(bootstrap, f"{topic_in}.dlq") as dlq,
    ):
        outputs = await out.wait_for(2000 - 40, timeout=60)
        dead = await dlq.wait_for(40, timeout=30)
        # What /metrics shows of it: the committed counts, and no lag once every record was read.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(EnricherCollector(enricher, topic_in))
        await wait_until(
            lambda: (
                enricher.stats.enriched + enricher.stats.dead_lettered == 2000
                and len(enricher.lag()) == PARTITIONS
                and sum(enricher.lag().values()) == 0
            ),
            what="the enricher caught up, every transaction counted",
        )
        scraped = {
            (sample.name, sample.labels.get("partition")): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples
        }
    check_exactly_once(outputs, dead, where, bad_every=50)
    assert enricher.stats.enriched == 1960
    assert enricher.stats.dead_lettered == 40
    assert scraped[("leaf_enrich_records_total", None)] == 1960
    assert scraped[("leaf_enrich_dead_letters_total", None)] == 40
    assert scraped[("leaf_enrich_transactions_committed_total", None)] >= 2000 / 300
    assert scraped[("leaf_enrich_transactions_aborted_total", None)] == 0
    assert [scraped[("leaf_enrich_lag_records", str(p))] for p in range(PARTITIONS)] == [0] * PARTITIONS


@pytest.mark.slow
async def test_exactly_once_through_three_sigkills(
    kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path
) -> None:
    """15,000 records, the enricher SIGKILLed three times mid-stream: each input exactly once in the output.

    A read_committed reader sees exactly one enriched record per good input record, and exactly the planted
    bad ones in the dead-letter topic. Transactions of at most 300 records (or 100 ms) are open at every
    kill, so a dozen or more commit between two kills. (This was 200,000 records in transactions of up to
    1,000, then 30,000: a kill lands mid-transaction either way, and the volume cost the suite 1-2.5
    minutes, then 47-80 s on two busy cores; the large-volume run is the soak.)
    """
    total, bad_every = 15_000, 997
    await prepare(pg_dsn, [("order", 5000)])
    bootstrap = kafka_broker.bootstrap
    topic_in, topic_out, where = await make_stream(bootstrap, total, bad_every)
    bad = total // bad_every
    args = [
        "--in",
        topic_in,
        "--out",
        topic_out,
        "--tag",
        "order",
        "--field",
        "order.id",
        "--group",
        unique("eos"),
        *("--commit-records", "300"),
    ]
    enricher = EnricherProcess(args, kafka_env(bootstrap, pg_dsn), tmp_path / "enrich.log")
    kills = 0
    async with TopicReader(bootstrap, topic_out) as out, TopicReader(bootstrap, f"{topic_in}.dlq") as dlq:
        enricher.start()
        try:
            for fraction in (0.15, 0.4, 0.65):
                while len(out.records) < fraction * total:
                    assert enricher.alive(), enricher.log_path.read_text()[-3000:]
                    await asyncio.sleep(0.05)
                enricher.kill()  # mid-stream, with transactions open
                kills += 1
                enricher.start()
            outputs = await out.wait_for(total - bad, timeout=180)
            dead = await dlq.wait_for(bad, timeout=30)
        finally:
            status = enricher.stop()
    assert kills == 3
    assert status == 0, enricher.log_path.read_text()[-3000:]
    check_exactly_once(outputs, dead, where, bad_every)


class _SteadyInput:
    """Produces input records (see :func:`record_for`) at a steady rate until stopped, remembering where each went.

    A stream fed at a bounded rate is still flowing when a test's fault comes, however fast the machine
    enriches; records produced all up front had to be many (40,000) for an idle machine not to finish
    them before the fault.
    """

    def __init__(self, bootstrap: str, topic: str, bad_every: int, per_second: int) -> None:
        self._bootstrap, self._topic = bootstrap, topic
        self._bad_every, self._per_second = bad_every, per_second
        self.where: dict[tuple[int, int], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def __aenter__(self) -> _SteadyInput:
        self._task = asyncio.create_task(self._feed())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> dict[tuple[int, int], int]:
        """Stop after the batch under way (every record produced is in :attr:`where`); returns it."""
        if self._task is not None:
            task, self._task = self._task, None
            self._stopping.set()
            await task
        return self.where

    async def _feed(self) -> None:
        batch, n = self._per_second // 10, 0
        producer = input_producer(self._bootstrap)  # one for the whole feed
        await producer.start()
        try:
            while not self._stopping.is_set():  # a stop lets the batch under way finish: where holds it all
                records = [record_for(i, self._bad_every) for i in range(n, n + batch)]
                placed = await send_all(
                    producer, self._topic, records, timestamp_ms=functools.partial(_nth, n)
                )
                self.where.update({at: n + i for i, at in enumerate(placed)})
                n += batch
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 0.1)
        finally:
            await producer.stop()


@pytest.mark.slow
async def test_an_enricher_killed_during_a_rebalance(
    kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path
) -> None:
    """Two enrichers in one group; the first is SIGKILLed while the second joins: still exactly once.

    The input flows at a steady 2,000 records a second through the join and the kill, so the kill always
    comes mid-stream (40,000 records produced up front were needed for that before, on an idle machine).
    """
    bad_every = 501
    await prepare(pg_dsn, [("order", 2000)])
    bootstrap = kafka_broker.bootstrap
    topic_in, topic_out = unique("orders.raw"), unique("orders.enriched")
    await create_topics(
        bootstrap, {topic_in: PARTITIONS, topic_out: PARTITIONS, f"{topic_in}.dlq": PARTITIONS}
    )
    args = [
        *("--in", topic_in, "--out", topic_out, "--tag", "order", "--field", "order.id"),
        *("--group", unique("eos2"), "--commit-records", "200"),
    ]
    env = kafka_env(bootstrap, pg_dsn)
    first = EnricherProcess(args, env, tmp_path / "first.log")
    second = EnricherProcess(args, env, tmp_path / "second.log")
    async with TopicReader(bootstrap, topic_out) as out, TopicReader(bootstrap, f"{topic_in}.dlq") as dlq:
        first.start()
        try:
            async with _SteadyInput(bootstrap, topic_in, bad_every, per_second=2000) as feed:
                while len(out.records) < 1000:
                    assert first.alive(), first.log_path.read_text()[-3000:]
                    await asyncio.sleep(0.05)
                second.start()
                # The group rebalances once the second member joins; kill the first while that is under way.
                log = second.log_path
                while "enriching" not in (log.read_text() if log.exists() else ""):
                    assert second.alive(), log.read_text()[-3000:] if log.exists() else "no log"
                    await asyncio.sleep(0.02)
                first.kill()
                killed_at = len(feed.where)
                # Input keeps coming after the kill, for the survivor alone: a second's worth of it.
                await wait_until(
                    lambda: len(feed.where) >= killed_at + 2000, what="2,000 records after the kill"
                )
            where = feed.where
            assert len(where) > killed_at, "no input after the kill"
            bad = sum(1 for i in where.values() if i % bad_every == bad_every - 1)
            outputs = await out.wait_for(len(where) - bad, timeout=120)
            dead = await dlq.wait_for(bad, timeout=30)
        finally:
            first.stop()
            status = second.stop()
    assert status == 0, second.log_path.read_text()[-3000:]
    check_exactly_once(outputs, dead, where, bad_every)


async def test_a_producer_whose_sender_died_is_replaced(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """A transactional producer left in aiokafka's FATAL_ERROR state: its partition is taken over, not lost.

    aiokafka 0.12 ends a producer's sender task when the connection drops during a FindCoordinator lookup
    (seen when a broker restarts); the producer then refuses every call (an ``assert`` in begin_transaction,
    IllegalOperation on a send), which once ended the whole enricher. This puts every producer in that state
    the way aiokafka's sender does when its task dies (a private API: the fault cannot be timed from outside),
    once between transactions and once inside one, and checks that enrichment goes on, exactly once.
    """
    await prepare(pg_dsn, [("order", 500)])
    bootstrap = kafka_broker.bootstrap
    topic_in, topic_out, where = await make_stream(bootstrap, 400, bad_every=0)
    async with enriching_order(bootstrap, pg_dsn, topic_in, topic_out, commit_records=100) as (
        enricher,
        running,
    ):
        async with TopicReader(bootstrap, topic_out) as out:
            await out.wait_for(400, timeout=60)
            broken = 0
            for part in list(enricher._partitions.values()):  # between transactions (begin is refused)
                if part.producer._txn_manager._transaction_waiter is None:
                    # Taken over again (a rebalance on a loaded machine): this producer never began a
                    # transaction, and aiokafka's fatal_error assumes one did. One empty transaction first.
                    await part.producer.begin_transaction()
                    await part.producer.commit_transaction()
                _kill_sender(part.producer)
                broken += 1
            placed = await produce(
                bootstrap,
                topic_in,
                (record_for(i, 0) for i in range(400, 800)),
                timestamp_ms=lambda i: timestamp_of(400 + i),
            )
            where.update({p: 400 + i for i, p in enumerate(placed)})
            await out.wait_for(800, timeout=30)
            for part in list(enricher._partitions.values()):  # inside a transaction (a send is refused)
                await part.producer.begin_transaction()
                part.in_transaction = True
                _kill_sender(part.producer)
                broken += 1
            placed = await produce(
                bootstrap,
                topic_in,
                (record_for(i, 0) for i in range(800, 1200)),
                timestamp_ms=lambda i: timestamp_of(800 + i),
            )
            where.update({p: 800 + i for i, p in enumerate(placed)})
            outputs = await out.wait_for(1200, timeout=30)
        assert not running.done(), running
    assert broken == 2 * PARTITIONS
    assert enricher.stats.aborted >= broken
    check_exactly_once(outputs, [], where, bad_every=0)


def _kill_sender(producer: AIOKafkaProducer) -> None:
    """What aiokafka does when a producer's sender task dies with an error (``Sender._fail_all``)."""
    error = KafkaError("Unexpected error during batch delivery (injected)")
    producer._message_accumulator.fail_all(error)
    producer._txn_manager.fatal_error(error)


async def test_with_key_outputs_stay_on_their_inputs_partition(
    kafka_broker: KafkaBroker, pg_dsn: str
) -> None:
    """--key: the ID becomes the key, yet each output lands on its input's partition, in order, timestamp kept."""
    await prepare(pg_dsn, [("order", 500)])
    bootstrap = kafka_broker.bootstrap
    topic_in, topic_out, where = await make_stream(bootstrap, 400, bad_every=0)
    config = kafka_config(bootstrap, pg_dsn)
    settings = EnrichSettings(
        input_topic=topic_in,
        output_topic=topic_out,
        tag="order",
        placement=Placement.from_options(key=True),
        group_id=unique("enrich"),
        commit_records=100,
    )
    async with enriching(config, settings), TopicReader(bootstrap, topic_out) as out:
        outputs = await out.wait_for(400, timeout=60)
    assert len(outputs) == 400
    ids = [int(record.key or b"") for record in outputs]
    assert len(set(ids)) == 400
    for record in outputs:
        partition, offset = source_of(record)
        assert record.partition == partition, "the new key does not choose the partition"
        assert record.timestamp == timestamp_of(where[(partition, offset)])
        assert json.loads(record.value or b"")["n"] == where[(partition, offset)], "the value is untouched"
    for partition in range(PARTITIONS):  # in input order, with increasing IDs (one worker's segments)
        mine = [r for r in outputs if r.partition == partition]
        assert [source_of(r)[1] for r in mine] == sorted(source_of(r)[1] for r in mine)
