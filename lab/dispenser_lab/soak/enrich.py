"""Enrichment under the fault schedule: a steady input stream through ``dispenser enrich``, checked at the end.

In the ``ha`` profiles a feeder writes records to ``soak.orders`` (four partitions, replicated on the three
brokers) at a steady rate while the faults go on (a broker kill -9, a PostgreSQL failover, the enricher
itself killed with SIGKILL and started again). Every 50th record cannot take an ID (not JSON): it must end
up in the dead-letter topic. At the end the feeder stops, the enricher is given time to finish, and the
whole stream is read back, ``read_committed``:

* every input record is in the output or the dead-letter topic, **exactly once** (by its ``leaf-source``
  header), the fit ones in the output and the unfit ones in the dead-letter topic;
* the enriched IDs are unique, and they join the soak's ledger of the same tag (``soak-a``), which the NATS
  and Kafka clients draw from too: an ID given to a record and to a client would be a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.connection import ensure_topics
from dispenser.adapters.kafka.offsets import CommittedOffsets
from dispenser.config import KafkaConfig

__all__ = ["ENRICH_GROUP", "ENRICH_TAG", "EnrichResult", "EnrichStream", "enricher_args"]

log = logging.getLogger(__name__)

INPUT_TOPIC = "soak.orders"
OUTPUT_TOPIC = "soak.orders.enriched"
DLQ_TOPIC = f"{INPUT_TOPIC}.dlq"
ENRICH_GROUP = "soak-enrich"
ENRICH_TAG = "soak-a"
"""The tag the enricher draws from: one the clients draw from too, so that the ledger sees both."""
PARTITIONS = 4
BAD_EVERY = 50
SOURCE_HEADER = "leaf-source"


def enricher_args() -> list[str]:
    """``dispenser enrich`` arguments for the soak's stream."""
    return [
        *("--in", INPUT_TOPIC, "--out", OUTPUT_TOPIC, "--tag", ENRICH_TAG, "--field", "id"),
        *("--group", ENRICH_GROUP, "--commit-records", "200", "--commit-interval", "0.2"),
    ]


@dataclass
class EnrichResult:
    """What the read-back found."""

    fed: int = 0
    """Input records in the topic at the end."""
    enriched: int = 0
    dead_lettered: int = 0
    twice: int = 0
    """Input records found more than once in the output and dead-letter topics together."""
    missing: int = 0
    misplaced: int = 0
    """Fit records dead-lettered, or unfit ones enriched."""
    caught_up_s: float | None = None
    """Seconds the enricher took to commit the whole input after the feeder stopped (None: it never did)."""
    send_errors: int = 0
    ids: list[int] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The figures for the JSON report (without the IDs)."""
        return {
            "fed": self.fed,
            "enriched": self.enriched,
            "dead_lettered": self.dead_lettered,
            "twice": self.twice,
            "missing": self.missing,
            "misplaced": self.misplaced,
            "caught_up_s": self.caught_up_s,
            "send_errors": self.send_errors,
            "examples": self.examples,
        }

    def failures(self) -> list[str]:
        """Why the stream broke its promise (empty when it kept it)."""
        found = []
        if self.fed == 0:
            found.append("enrichment: no input record was written")
        if self.caught_up_s is None:
            found.append("enrichment: the enricher never committed the whole input")
        for what, count in (("twice", self.twice), ("missing", self.missing), ("misplaced", self.misplaced)):
            if count:
                found.append(f"enrichment: {count} input records {what} ({'; '.join(self.examples[:3])})")
        if len(set(self.ids)) != len(self.ids):
            found.append(f"enrichment: {len(self.ids) - len(set(self.ids))} IDs given to two records")
        return found


class EnrichStream:
    """The input feeder and the read-back; the enricher process itself is the cluster's.

    Args:
        kafka: How to reach the brokers.
        rate: Input records per second while feeding.
    """

    def __init__(self, kafka: KafkaConfig, rate: float = 400.0) -> None:
        self.kafka = kafka
        self.rate = rate
        self.sent = 0
        self.send_errors = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def create_topics(self) -> None:
        """The input, output and dead-letter topics (replicated as the cluster allows)."""
        await ensure_topics(self.kafka, dict.fromkeys((INPUT_TOPIC, OUTPUT_TOPIC, DLQ_TOPIC), PARTITIONS))

    async def start_feeding(self) -> None:
        """Start writing input records in the background."""
        self._task = asyncio.create_task(self._feed(), name="enrich-feeder")

    async def stop_feeding(self) -> None:
        """Stop the feeder after the record in hand."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _feed(self) -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=self.kafka.bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            request_timeout_ms=10_000,
        )
        await producer.start()
        pending: set[asyncio.Future[Any]] = set()
        began, n = time.monotonic(), 0
        try:
            while not self._stop.is_set():
                due = began + n / self.rate
                if (delay := due - time.monotonic()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
                    continue
                bad = n % BAD_EVERY == BAD_EVERY - 1
                value = b"not json" if bad else json.dumps({"n": n}).encode()
                try:
                    sent = await producer.send(
                        INPUT_TOPIC, value, key=str(n).encode(), partition=n % PARTITIONS
                    )
                except KafkaError:
                    self.send_errors += 1  # its buffer is full while a broker is away: the record is skipped
                else:
                    pending.add(sent)
                    sent.add_done_callback(self._sent)
                    sent.add_done_callback(pending.discard)
                n += 1
            if pending:
                await asyncio.wait(pending, timeout=30)
        finally:
            await producer.stop()

    def _sent(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.send_errors += 1
        else:
            self.sent += 1

    async def finish(self, timeout: float = 120.0) -> EnrichResult:
        """Wait until the enricher has committed the whole input, then read everything back and check it."""
        result = EnrichResult(send_errors=self.send_errors)
        inputs = await _read_all(self.kafka, INPUT_TOPIC, committed=False)
        ends = {
            tp: max((r.offset for r in inputs if r.partition == tp.partition), default=-1) + 1
            for tp in _tps()
        }
        began = time.monotonic()
        offsets = CommittedOffsets(self.kafka, ENRICH_GROUP)
        try:
            while time.monotonic() - began < timeout:
                try:
                    done = True
                    for tp, end in ends.items():
                        if end and (await offsets.committed(tp) or 0) < end:
                            done = False
                            break
                except KafkaError as exc:
                    log.info("enrichment: committed offsets not readable yet: %r", exc)
                    done = False
                if done:
                    result.caught_up_s = round(time.monotonic() - began, 1)
                    break
                await asyncio.sleep(0.5)
        finally:
            await offsets.close()
        outputs = await _read_all(self.kafka, OUTPUT_TOPIC, committed=True)
        dead = await _read_all(self.kafka, DLQ_TOPIC, committed=True)
        _judge(result, inputs, outputs, dead)
        return result


def _tps() -> list[TopicPartition]:
    return [TopicPartition(INPUT_TOPIC, p) for p in range(PARTITIONS)]


async def _read_all(kafka: KafkaConfig, topic: str, *, committed: bool) -> list[Any]:
    """Every record of ``topic`` up to its end now (its last stable offset under ``read_committed``)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers,
        isolation_level="read_committed" if committed else "read_uncommitted",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[Any] = []
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            positions = [await consumer.position(tp) for tp in tps]
            if all(position >= ends[tp] for position, tp in zip(positions, tps, strict=True)):
                break
            for batch in (await consumer.getmany(*tps, timeout_ms=500)).values():
                records += batch
    finally:
        await consumer.stop()
    return records


def _source(record: Any) -> tuple[int, int] | None:
    """The input ``(partition, offset)`` of an output or dead letter: its last ``leaf-source`` header."""
    found = None
    for key, value in record.headers or ():
        if key == SOURCE_HEADER:
            _topic, partition, offset = value.decode().rsplit("/", 2)
            found = int(partition), int(offset)
    return found


def _judge(result: EnrichResult, inputs: list[Any], outputs: list[Any], dead: list[Any]) -> None:
    bad = {(r.partition, r.offset) for r in inputs if r.value == b"not json"}
    every = {(r.partition, r.offset) for r in inputs}
    result.fed = len(every)
    result.enriched, result.dead_lettered = len(outputs), len(dead)
    seen = Counter(_source(r) for r in [*outputs, *dead])
    twice = [source for source, n in seen.items() if n > 1]
    missing = every - set(seen)
    misplaced: list[tuple[int, int] | None] = [s for s in (_source(r) for r in outputs) if s in bad]
    misplaced += [s for s in (_source(r) for r in dead) if s not in bad]
    result.twice, result.missing, result.misplaced = len(twice), len(missing), len(misplaced)
    result.examples = [
        f"{what} {s}"
        for what, group in (("twice", twice), ("missing", sorted(missing)), ("misplaced", misplaced))
        for s in list(group)[:3]
    ]
    for record in outputs:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            result.ids.append(int(json.loads(record.value)["id"]))
