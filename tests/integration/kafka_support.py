"""Helpers for the Kafka tests: configs, unique topics, producing and reading back whole topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from dispenser.adapters.kafka.connection import ensure_topics, topic_partitions
from dispenser.adapters.kafka.enrich import Enricher, EnrichSettings
from dispenser.app import Worker
from dispenser.config import Config, KafkaConfig, load_config
from dispenser_lab.servers import KafkaBroker
from dispenser_lab.servers.kafka_markers import DroppedMarkers

Header = tuple[str, bytes]


def unique(name: str) -> str:
    """A topic or group name no other test uses."""
    return f"{name}-{uuid.uuid4().hex[:10]}"


def serving_topics() -> dict[str, object]:
    """Settings for :func:`kafka_env`: Kafka requests served, on request and reply topics and a group of their own."""
    return {
        "kafka_enabled": True,
        "kafka_request_topic": unique("requests"),
        "kafka_reply_topic": unique("replies"),
        "kafka_group_id": unique("group"),
    }


def kafka_env(bootstrap: str, dsn: str | None = None, **settings: object) -> dict[str, str]:
    """``DISPENSER_*`` variables for a Kafka-only worker on ``bootstrap``; ``settings`` as ``SECTION_NAME``."""
    env = {
        "DISPENSER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "DISPENSER_NATS_ENABLED": "false",
        # Short sessions: a killed worker's partitions move on within about a second.
        "DISPENSER_KAFKA_SESSION_TIMEOUT_MS": "1500",
        "DISPENSER_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
    }
    if dsn is not None:
        env["DISPENSER_POSTGRES_DSN"] = dsn
    else:
        env["DISPENSER_SEGMENT_ENABLED"] = "false"
    env |= {
        f"DISPENSER_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in settings.items()
    }
    return env


def kafka_config(bootstrap: str, dsn: str | None = None, **settings: object) -> Config:
    """A config from :func:`kafka_env`."""
    return load_config(environ=kafka_env(bootstrap, dsn, **settings))


async def create_topics(bootstrap: str, topics: Mapping[str, int]) -> None:
    """Create topics (name → partitions)."""
    await ensure_topics(KafkaConfig(bootstrap_servers=bootstrap), topics)


@dataclass(frozen=True, slots=True)
class Record:
    """A record as read back."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[Header]
    timestamp: int = 0
    """The record's timestamp (ms since 1970), as the broker stored it."""

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``."""
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found


async def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[int, bytes | None, bytes | None, list[Header]]],
    timestamp_ms: Callable[[int], int] | None = None,
) -> list[tuple[int, int]]:
    """Produce ``(partition, key, value, headers)`` records in order; returns their ``(partition, offset)``.

    ``timestamp_ms(i)``: the timestamp of the ``i``-th record (default: the producer's clock).
    """
    producer = input_producer(bootstrap)
    await producer.start()
    try:
        return await send_all(producer, topic, records, timestamp_ms)
    finally:
        await producer.stop()


def input_producer(bootstrap: str) -> AIOKafkaProducer:
    """The producer :func:`produce` uses (not started): idempotent, ``acks=all``, records in order."""
    return AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, enable_idempotence=True)


async def send_all(
    producer: AIOKafkaProducer,
    topic: str,
    records: Iterable[tuple[int, bytes | None, bytes | None, list[Header]]],
    timestamp_ms: Callable[[int], int] | None = None,
) -> list[tuple[int, int]]:
    """Send records with a started producer and wait for them; their ``(partition, offset)`` in order."""
    futures = [
        await producer.send(
            topic,
            value,
            key=key,
            partition=partition,
            headers=headers,
            timestamp_ms=None if timestamp_ms is None else timestamp_ms(i),
        )
        for i, (partition, key, value, headers) in enumerate(records)
    ]
    return [(m.partition, m.offset) for m in await asyncio.gather(*futures)]


@contextlib.asynccontextmanager
async def repairing_dropped_markers(broker: KafkaBroker) -> AsyncIterator[list[DroppedMarkers]]:
    """Meanwhile, write the transaction markers ``broker``'s coordinator drops at a restart, as an operator would.

    Kafka's bug, not ours (:mod:`dispenser_lab.servers.kafka_markers`): a single node killed while a
    transaction commits may skip its markers when it comes back (or lose them, restarted cleanly),
    leaving the transaction open for ever on the output and the group's offset pending; the enricher
    then waits, as it must. Written as the
    coordinator decided them, the stream goes on, and the test's exactly-once check still holds. Yields the
    list of those repaired (each also printed).
    """
    repaired: list[DroppedMarkers] = []

    async def repair() -> None:
        while True:
            for dropped in await asyncio.to_thread(broker.repair_dropped_markers):
                print(f"Kafka dropped transaction markers at its restart; written now: {dropped}")
                repaired.append(dropped)
            await asyncio.sleep(0.5)

    task = asyncio.create_task(repair())
    try:
        yield repaired
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def enriching(
    config: Config, settings: EnrichSettings
) -> AsyncIterator[tuple[Enricher, asyncio.Task[None]]]:
    """An :class:`Enricher` with ``settings`` running here, its IDs from a worker of ``config``.

    Yields the enricher and its running task. On a normal exit it is stopped and the task awaited (its
    error, if any, raised); on a failure the task is given 30 s to stop, then cancelled, so that a test
    that failed half-way does not hang in its teardown. The worker is stopped in any case.
    """
    worker = Worker(config, serve=False)
    await worker.start()
    stop = asyncio.Event()
    running: asyncio.Task[None] | None = None
    try:
        enricher = Enricher(config.kafka, settings, worker.allocator)
        await enricher.start()
        running = asyncio.create_task(enricher.run(stop))
        yield enricher, running
        stop.set()
        await running
    finally:
        stop.set()
        if running is not None and not running.done():
            await asyncio.wait({running}, timeout=30)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        await worker.stop()


async def leave_undecided(
    bootstrap: str, transactional_id: str, topic: str, partition: int, *, value: bytes, headers: list[Header]
) -> tuple[int, int]:
    """Leave ``transactional_id``'s producer a record on ``topic[partition]`` that no transaction will decide.

    The state Kafka leaves when it drops a transaction's marker on a partition at a restart (``docs/kafka.md``,
    hanging transactions): the producer ID has an undecided record there that its coordinator does not
    know of. Made here by sending the record without adding the partition to a transaction, which only a
    broker with ``transaction.partition.verification.enable=false`` accepts. Returns the producer ID and
    epoch (whose marker, written with ``write_txn_markers``, decides the record).
    """
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=transactional_id)
    await producer.start()  # InitProducerId: the ID and epoch the record is written with
    try:
        return await send_undecided(producer, topic, partition, value=value, headers=headers)
    finally:
        await producer.stop()


async def send_undecided(
    producer: AIOKafkaProducer, topic: str, partition: int, *, value: bytes, headers: list[Header]
) -> tuple[int, int]:
    """Send one record as ``producer``'s (a started transactional one), in no transaction; see :func:`leave_undecided`.

    It takes the producer's next sequence number there, so that the producer's own records follow it.
    Returns the producer ID and epoch.
    """
    manager = producer._txn_manager  # aiokafka has no public way to send outside its transactions
    pid, epoch = manager.producer_id, manager.producer_epoch
    tp = TopicPartition(topic, partition)
    batch = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=1,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=manager.sequence_number(tp),
        batch_size=1 << 20,
    )
    batch.append(0, timestamp=None, key=None, value=value, headers=headers)
    await producer.client._wait_on_metadata(topic)
    request = ProduceRequest(
        required_acks=-1,
        timeout=10_000,
        topics=[(topic, [(partition, bytes(batch.build()))])],
        transactional_id=manager.transactional_id,
    )
    response = await producer.client.send(producer.client.cluster.leader_for_partition(tp), request)
    errors = [error for _topic, parts in response.topics for _p, error, *_rest in parts]
    assert errors == [0], f"the broker refused the record: {errors}"
    manager.increment_sequence_number(tp, 1)
    return pid, epoch


class TopicReader:
    """Reads a whole topic (``read_committed`` by default) in the background, keeping every record."""

    def __init__(self, bootstrap: str, topic: str, *, committed: bool = True) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.records: list[Record] = []
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed" if committed else "read_uncommitted",
        )
        self._task: asyncio.Task[None] | None = None
        # Per partition, the offset below which every record is in ``records``: the consumer's position,
        # read by ``_read`` after it appended what ``getmany`` returned (so never ahead of the list).
        self._read_to: dict[TopicPartition, int] = {}
        self._progress = asyncio.Event()

    async def __aenter__(self) -> TopicReader:
        consumer = self._consumer
        await consumer.start()
        partitions = await topic_partitions(KafkaConfig(bootstrap_servers=self.bootstrap), self.topic)
        self.tps = [TopicPartition(self.topic, p) for p in range(partitions)]
        consumer.assign(self.tps)
        await consumer.seek_to_beginning(*self.tps)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    async def _read(self) -> None:
        while True:
            fetched = await self._consumer.getmany(timeout_ms=200)
            for records in fetched.values():
                self.records.extend(
                    Record(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers), r.timestamp)
                    for r in records
                )
            # Only this task consumes, so the positions read now cover exactly what was appended above
            # (under read_committed they also step over commit markers and aborted records).
            self._read_to = {tp: await self._consumer.position(tp) for tp in self.tps}
            self._progress.set()

    async def wait_for(self, count: int, timeout: float) -> list[Record]:
        """Wait until at least ``count`` records were read; then until the reader is at the topic's end."""
        deadline = time.monotonic() + timeout
        while len(self.records) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.topic}: {len(self.records)} of {count} records after {timeout} s"
                )
            await asyncio.sleep(0.1)
        await self.wait_caught_up(deadline - time.monotonic())
        return self.records

    async def wait_caught_up(self, timeout: float = 10.0) -> None:
        """Wait until every record visible now is in :attr:`records`: no time guessed, positions compared.

        The ends are read once, now: under read_committed ``end_offsets`` is each partition's last stable
        offset, below which every record is decided (committed or aborted). Then wait until the reader
        has appended everything below those ends; a late duplicate already committed cannot be missed.
        """
        deadline = time.monotonic() + max(timeout, 1.0)
        ends = await self._consumer.end_offsets(self.tps)  # the LSO under read_committed
        while not all(self._read_to.get(tp, -1) >= ends[tp] for tp in self.tps):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.topic}: reader did not catch up ({self._read_to} < {ends})")
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), remaining)


class DispenserProcess:
    """A ``dispenser`` command in a child process, its output appended to a log file (the secret scan reads it)."""

    def __init__(self, args: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.args = args
        self.env = os.environ | dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (output appended to the log)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dispenser", *self.args],
                env=self.env,
                stdout=log,
                stderr=log,
            )

    def log(self) -> str:
        """Everything it wrote so far (all its runs)."""
        return self.log_path.read_text(errors="replace")

    async def wait_for_line(self, text: str, timeout: float = 30.0) -> None:
        """Wait until ``text`` shows up in its log; fail with the log if it exits or takes too long."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.log()[-3000:]}"
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL it: a crash, mid-transaction."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 15 s); returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class EnricherProcess(DispenserProcess):
    """``dispenser enrich`` in a child process (logging at INFO), to SIGKILL and restart."""

    def __init__(self, args: list[str], env: Mapping[str, str], log_path: Path) -> None:
        super().__init__(["enrich", *args], dict(env) | {"DISPENSER_LOG_LEVEL": "INFO"}, log_path)
