"""Item 8 of issue 16: of three Kafka brokers, the one that is both transaction coordinator and a partition leader dies.

Under load: ``dispenser enrich`` (in process, transactional consume-transform-produce, ``read_committed``)
on a stream fed continuously, and four requesters asking a Kafka-serving worker for IDs over
request/reply. The topics the dispenser creates get its default replication factor (3 here); the input
topic is placed so that the enricher's transaction coordinator also leads its partition 0, and that broker
is killed (SIGKILL): one kill takes the coordinator and a leader (usually more: the group coordinator,
leaders of the output or request topics; the test prints which). Afterwards every input record appears
exactly once in the output, and no ID was handed out twice (request/reply and enrichment draw from one tag).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.clients import ensure_topics
from dispenser.adapters.kafka.enrich import SOURCE_HEADER, Enricher, EnrichSettings
from dispenser.client import KafkaIdClient
from dispenser.config import Config, KafkaConfig
from dispenser.service.enrichment import Placement
from dispenser.testing.servers import KafkaCluster
from tests.ha.cluster_support import restored
from tests.ha.load_support import until
from tests.integration.kafka_support import Record, TopicReader, kafka_config, unique
from tests.integration.segment_support import prepare, running_worker

pytestmark = [pytest.mark.ha, pytest.mark.kafka, pytest.mark.postgres]

TAG = "order"
PARTITIONS = 2
REQUEST_TIMEOUT_MS = 5000
STALL_BOUND = 30.0
"""Seconds any flow may stand still after a kill: generous (measured: about the 3 s broker session plus
metadata refreshes); it proves the flow resumes by itself."""


@dataclass
class Requests:
    """What the request/reply requesters saw: IDs with the time of each answer, timeouts, error codes."""

    answered: list[tuple[float, list[int]]] = field(default_factory=list)
    timeouts: int = 0
    send_errors: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    not_retryable: list[str] = field(default_factory=list)

    def last_before(self, at: float) -> float:
        return max((t for t, _ in self.answered if t <= at), default=at)

    def first_after(self, at: float) -> float | None:
        return min((t for t, _ in self.answered if t > at), default=None)


async def _request_loop(client: KafkaIdClient, seen: Requests, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            reply = await client.request(TAG, 10, timeout=3.0)
        except TimeoutError:
            seen.timeouts += 1
            continue
        except OSError:
            seen.send_errors += 1
            await asyncio.sleep(0.1)
            continue
        if reply.error is not None:
            seen.errors[reply.error.code] += 1
            if not reply.error.retryable:
                seen.not_retryable.append(f"{reply.error.code}: {reply.error.message}")
            await asyncio.sleep(0.05)
            continue
        assert reply.ids is not None
        seen.answered.append((time.monotonic(), reply.ids))


@contextlib.asynccontextmanager
async def requesting(config: Config, count: int) -> AsyncIterator[Requests]:
    """``count`` requesters over Kafka request/reply until the block ends."""
    seen = Requests()
    stop = asyncio.Event()
    async with KafkaIdClient(config.kafka, timeout=3.0) as client:
        tasks = [asyncio.create_task(_request_loop(client, seen, stop)) for _ in range(count)]
        try:
            yield seen
        finally:
            stop.set()
            await asyncio.gather(*tasks)


@contextlib.asynccontextmanager
async def feeding(bootstrap: str, topic: str, per_second: float) -> AsyncIterator[list[int]]:
    """Produce JSON records to ``topic`` steadily (idempotent, acks=all) until the block ends.

    Yields a one-item list counting the sends that failed (the records in the topic are what counts:
    the check reads the input topic back).
    """
    failed = [0]
    stop = asyncio.Event()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        request_timeout_ms=30000,
    )
    await producer.start()

    async def feed() -> None:
        n = 0
        while not stop.is_set():
            batch = [
                await producer.send(
                    topic, json.dumps({"n": n + i, "order": {}}).encode(), partition=(n + i) % PARTITIONS
                )
                for i in range(10)
            ]
            n += 10
            for result in await asyncio.gather(*batch, return_exceptions=True):
                if isinstance(result, (KafkaError, OSError)):
                    failed[0] += 1
            await asyncio.sleep(10 / per_second)

    task = asyncio.create_task(feed())
    try:
        yield failed
    finally:
        stop.set()
        await task
        await producer.stop()


class Progress:
    """Samples a growing count every 50 ms, to find the longest time it stood still."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count
        self.samples: list[tuple[float, int]] = []
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.count()))
            await asyncio.sleep(0.05)

    def stall(self, since: float) -> float:
        """The longest time after ``since`` during which the count did not grow (up to now if it still does not)."""
        longest, changed_at, last = 0.0, since, None
        for at, value in self.samples:
            if at < since:
                last = value
                continue
            if last is None or value > last:
                longest = max(longest, at - changed_at)
                changed_at, last = at, value
        return max(longest, time.monotonic() - changed_at) if self.samples else float("inf")

    def grew_since(self, since: float) -> bool:
        before = [v for t, v in self.samples if t <= since]
        return bool(self.samples) and self.samples[-1][1] > (before[-1] if before else 0)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def create_placed_topic(bootstrap: str, topic: str, replicas: list[list[int]]) -> None:
    """Create ``topic`` with partition ``p`` on brokers ``replicas[p]`` (the first one leads)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        assignment = dict(enumerate(replicas))
        response = await admin.create_topics([NewTopic(topic, -1, -1, replica_assignments=assignment)])
        assert all(code == 0 for _, code, *_ in response.topic_errors), response
    finally:
        await admin.close()


def both_grew_since(first: Progress, second: Progress, at: float) -> Callable[[], bool]:
    """A check that both counts grew after ``at``."""
    return lambda: first.grew_since(at) and second.grew_since(at)


def source_of(record: Record) -> tuple[int, int]:
    raw = record.header(SOURCE_HEADER)
    assert raw is not None
    _topic, partition, offset = raw.decode().rsplit("/", 2)
    return int(partition), int(offset)


async def test_broker_kills_keep_exactly_once_and_unique_ids(
    kafka_cluster: KafkaCluster, pg_dsn: str
) -> None:
    await broker_fault(kafka_cluster, pg_dsn, "kill")


# `manual` (run with `scripts/test -m manual tests/ha/test_kafka_cluster.py -k frozen`): ~35 s, over the
# HA unit's budget, and it passed 1 of the 2 runs tried with the 5 s request timeout (the other failed
# before the freeze, on a machine loaded by a soak run; its cause was not seen).
@pytest.mark.manual
async def test_a_frozen_broker_keeps_exactly_once_and_unique_ids(
    kafka_cluster: KafkaCluster, pg_dsn: str
) -> None:
    """Issue 22 item 6: the same broker frozen (SIGSTOP) instead of killed, thawed once both flows resumed.

    Its sockets stay open and nothing answers: every client must give up on it by a deadline (the
    request timeout) rather than by a reset, and the controller fences it after its 3 s broker session.
    With aiokafka's 30 s (the default of ``kafka.request_timeout_ms``) the flows did not resume within
    30 s; with 5 s (set here) they resumed 5.5 s after the freeze (enrichment stood still 5.3 s,
    request/reply 3.3 s), every record enriched exactly once.
    """
    await broker_fault(kafka_cluster, pg_dsn, "freeze")


async def broker_fault(kafka_cluster: KafkaCluster, pg_dsn: str, fault: Literal["kill", "freeze"]) -> None:
    """Kill or freeze the enricher's transaction coordinator (also a partition leader) under both flows."""
    await prepare(pg_dsn, [(TAG, 1000)])
    bootstrap = kafka_cluster.bootstrap
    topic_in, topic_out = unique("ha8.raw"), unique("ha8.enriched")
    config = kafka_config(
        bootstrap,
        pg_dsn,
        kafka_enabled=True,
        kafka_request_topic=unique("ha8.requests"),
        kafka_reply_topic=unique("ha8.replies"),
        kafka_group_id=unique("ha8.serve"),
        # A frozen broker answers nothing: a request to it ends only at this timeout (the default of 30 s
        # held a flow for longer than the test waits). The kill test keeps the default, as before.
        kafka_request_timeout_ms=REQUEST_TIMEOUT_MS
        if fault == "freeze"
        else KafkaConfig().request_timeout_ms,
    )
    settings = EnrichSettings(
        input_topic=topic_in,
        output_topic=topic_out,
        tag=TAG,
        placement=Placement.from_options(field="order.id"),
        group_id=unique("ha8.enrich"),
        commit_records=100,
    )
    # The coordinator of the enricher's transactions (asking creates Kafka's transaction log if need be)
    # leads input partition 0, another broker partition 1.
    victim = kafka_cluster.transaction_coordinator(settings.transactional_id(0))
    others = [m.node_id for m in kafka_cluster.members if m is not victim]
    await create_placed_topic(bootstrap, topic_in, [[victim.node_id, *others], [*others, victim.node_id]])
    topics = [topic_in, topic_out, settings.dlq, config.kafka.request_topic, str(config.kafka.reply_topic)]
    stop = asyncio.Event()
    with restored(kafka_cluster):
        async with running_worker(config) as server, running_worker(kafka_config(bootstrap, pg_dsn)) as host:
            assert server.kafka is not None
            assert host.allocator is not None
            enricher = Enricher(config.kafka, settings, host.allocator)
            await enricher.start()
            enriching = asyncio.create_task(enricher.run(stop))
            async with (
                feeding(bootstrap, topic_in, per_second=400) as failed_sends,
                TopicReader(bootstrap, topic_out) as out,
                requesting(config, 4) as seen,
            ):
                # Thawed before anything unwinds: the clients' closes would wait on the frozen broker.
                with contextlib.ExitStack() as thawed:
                    enriched = Progress(lambda: len(out.records))
                    answered = Progress(lambda: len(seen.answered))
                    await until(
                        lambda: len(out.records) > 200 and len(seen.answered) > 50, 60, "both flows running"
                    )
                    # The dispenser created the output, dead-letter, request and reply topics: 3 replicas each.
                    await asyncio.to_thread(kafka_cluster.wait_in_sync, topics)
                    replicas = {topic: len(kafka_cluster.partition(topic).replicas) for topic in topics}
                    assert kafka_cluster.transaction_coordinator(settings.transactional_id(0)) is victim
                    assert kafka_cluster.partition(topic_in, 0).leader == victim.node_id
                    internal = [*topics, "__transaction_state", "__consumer_offsets"]
                    led = sorted(
                        f"{t}-{p}"
                        for (t, p), state in kafka_cluster.metadata(internal).partitions.items()
                        if state.leader == victim.node_id
                    )
                    killed_at = time.monotonic()
                    if fault == "kill":
                        await asyncio.to_thread(victim.kill)
                    else:
                        victim.freeze()
                        thawed.callback(victim.thaw)  # also on failure: restored() starts only the dead
                    # A worker starting now creates its topics while the metadata still lists the dead broker
                    # (until its 3 s session ends), which the admin requests may be sent to: they must get through.
                    late = [unique("ha8.late") for _ in range(3)]
                    for topic in late:
                        assert await ensure_topics(config.kafka, {topic: 1}) == [topic]
                    created_in = time.monotonic() - killed_at
                    await until(
                        both_grew_since(enriched, answered, killed_at + 0.5),
                        STALL_BOUND,
                        "enrichment and request/reply after the kill",
                    )
                    resumed_in = time.monotonic() - killed_at
                    # The broker comes back while the flows go on and the output is checked.
                    if fault == "kill":
                        restarting = asyncio.create_task(asyncio.to_thread(kafka_cluster.start))
                    else:
                        victim.thaw()
                        restarting = asyncio.create_task(asyncio.sleep(0))
                    await asyncio.sleep(2)
                    stalls = enriched.stall(killed_at), answered.stall(killed_at)
                    await enriched.close()
                    await answered.close()
            # Every input record, read back from the input topic, must come out exactly once.
            async with TopicReader(bootstrap, topic_in, committed=False) as source:
                await source.wait_caught_up(30)
            inputs = source.records
            async with TopicReader(bootstrap, topic_out) as out_all:
                outputs = await out_all.wait_for(len(inputs), timeout=60)
            stop.set()
            await enriching
        await restarting
    print(
        f"\nKafka broker {fault}: node {victim.node_id} (transaction coordinator; leading {', '.join(led)}): "
        f"both flows grew again {resumed_in:.2f} s after; "
        f"enrichment stood still {stalls[0]:.2f} s, request/reply {stalls[1]:.2f} s; "
        f"3 topics created just after the kill in {created_in:.2f} s; "
        f"{len(inputs)} records in, {len(outputs)} out; request/reply {len(seen.answered)} answers, "
        f"{seen.timeouts} timeouts, {seen.send_errors} send errors, error replies {dict(seen.errors)}; "
        f"{failed_sends[0]} failed input sends"
    )
    assert replicas == dict.fromkeys(topics, 3), replicas
    sources = Counter(source_of(r) for r in outputs)
    twice = [s for s, n in sources.items() if n > 1]
    assert not twice, f"{len(twice)} input records enriched more than once, e.g. {twice[:5]}"
    assert len(inputs) > 200
    assert set(sources) == {(r.partition, r.offset) for r in inputs}
    ids = [json.loads(r.value or b"")["order"]["id"] for r in outputs] + [
        i for _, got in seen.answered for i in got
    ]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} IDs handed out twice"
    assert seen.not_retryable == []
