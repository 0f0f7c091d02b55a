"""Issue 16 item 8 and issue 22 item 6: of three Kafka brokers, the transaction coordinator (and a leader) fails.

Under load: ``dispenser enrich`` (in process, transactional consume-transform-produce, ``read_committed``)
on a stream fed continuously, and four requesters asking a Kafka-serving worker for IDs over
request/reply. The topics the dispenser creates get its default replication factor (3 here); the input
topic is placed so that the enricher's transaction coordinator also leads its partition 0, and that broker
is killed (SIGKILL): one kill takes the coordinator and a leader (usually more: the group coordinator,
leaders of the output or request topics; the test prints which). Afterwards every input record appears
exactly once in the output, and no ID was handed out twice (request/reply and enrichment draw from one tag).

The second test makes the same broker hang instead (frozen), then cuts the clients' path to a broker one way
(through a fault proxy per broker): see its docstring for what each costs.
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

from dispenser.adapters.kafka.connection import ensure_topics
from dispenser.adapters.kafka.enrich import SOURCE_HEADER, Enricher, EnrichSettings
from dispenser.client import KafkaIdClient
from dispenser.config import Config, KafkaConfig
from dispenser.service.enrichment import Placement
from dispenser_lab.faultproxy import ThreadedFaultProxy
from dispenser_lab.servers import KafkaCluster
from tests.ha.cluster_support import restored
from tests.ha.load_support import until
from tests.integration.kafka_support import Record, TopicReader, kafka_config, unique
from tests.integration.segment_support import prepare, running_worker

pytestmark = [pytest.mark.ha, pytest.mark.kafka, pytest.mark.postgres]

TAG = "order"
PARTITIONS = 2
STALL_BOUND = 30.0
"""Seconds both flows have to grow again after a kill or a freeze (or the heal of a cut): generous
(measured: the 3 s broker session or the 5 s request timeout, plus metadata refreshes); it proves the
flows resume by themselves."""
HANG_BOUND = 60.0
"""The same for a frozen broker: each client learns of the hang only when a request to it times out
(``kafka.request_timeout_ms``, 5 s), and a flow may pay several in a row (measured: 3.2-25.1 s)."""
CUT_SECONDS = 6.0
"""How long the link is cut: past the request timeout (5 s), so that the clients give up on it once."""


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

    def resumed(self, since: float) -> float:
        """When the count first grew after ``since`` (now if it has not)."""
        before = [v for t, v in self.samples if t <= since]
        base = before[-1] if before else 0
        return min((t for t, v in self.samples if t > since and v > base), default=time.monotonic())

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
    """Issue 16 item 8: kill -9 of the transaction coordinator (also a partition leader) under both flows."""
    async with FaultRun.running(kafka_cluster, pg_dsn) as run:
        await run.fault("kill")
    run.check()


async def test_a_frozen_and_a_cut_off_broker_keep_exactly_once_and_unique_ids(
    kafka_cluster: KafkaCluster, kafka_proxies: list[ThreadedFaultProxy], pg_dsn: str
) -> None:
    """Issue 22 item 6: the broker frozen (SIGSTOP) instead of killed; then the clients' path to one cut.

    One run, two faults (one setup for both keeps the HA stage short). The dispenser's clients (the
    serving worker, the enricher, the requesters) reach the brokers through ``kafka_proxies``:

    1. The transaction coordinator, also leading input partition 0, is frozen: its sockets stay open and
       nothing answers, so every client gives up on it at ``kafka.request_timeout_ms`` rather than at a
       reset, while the controller fences it after its 3 s broker session and its partitions move. It is
       thawed once both flows have grown again.
    2. Once it is back in sync, the link from the (new) transaction coordinator to the clients is cut
       server to client for :data:`CUT_SECONDS`: every request reaches it and is carried out (produce,
       transaction commits, heartbeats) but no answer comes back. The brokers still see each other, so
       nothing moves: no Kafka client can go round a leader its cluster deems alive. The flows that need
       it wait for the heal; then they resume, and the requests carried out unanswered must not show up
       twice.

    The consumers keep the product's session (10 s; the other tests use 1.5 s): with 1.5 s every member
    lost its session about 3 s into the freeze (its heartbeats went unanswered for longer than that, the
    group coordinator's answers apparently held until the frozen replica left the ISR of its log, after
    the 3 s broker session), and each fault became a rebalance too.
    """
    async with FaultRun.running(kafka_cluster, pg_dsn, proxies=kafka_proxies) as run:
        await run.fault("freeze")
        await run.fault("cut")
    run.check()


Fault = Literal["kill", "freeze", "cut"]


@dataclass
class Phase:
    """What one fault cost, measured from its start (``cut``: also from its heal)."""

    fault: Fault
    victim: int
    led: list[str]
    resumed_in: float
    """Seconds from the fault (kill, freeze) or from the heal (cut) until both flows had grown again."""
    stalls: tuple[float, float]
    """The longest standstill of enrichment and of request/reply from the fault to the phase's end."""
    created_in: float
    """Seconds to create 3 topics (a worker starting), asked just after the fault."""

    def describe(self) -> str:
        since = "the heal" if self.fault == "cut" else f"the {self.fault}"
        return (
            f"Kafka broker {self.fault}: node {self.victim} (transaction coordinator; leading "
            f"{', '.join(self.led)}): both flows grew again {self.resumed_in:.2f} s after {since}; "
            f"enrichment stood still {self.stalls[0]:.2f} s, request/reply {self.stalls[1]:.2f} s; "
            f"3 topics created just after the fault in {self.created_in:.2f} s"
        )


@dataclass
class FaultRun:
    """Both flows running on the cluster, faults made one after another, and the checks afterwards."""

    cluster: KafkaCluster
    config: Config
    settings: EnrichSettings
    topics: list[str]
    proxies: list[ThreadedFaultProxy] | None
    enriched: Progress
    answered: Progress
    seen: Requests
    failed_sends: list[int]
    placed: int = 0
    """The broker placed as input partition 0's leader: the transaction coordinator at the start."""
    phases: list[Phase] = field(default_factory=list)
    restarting: asyncio.Task[None] | None = None
    """A killed broker's restart, under way while the flows go on."""
    inputs: list[Record] = field(default_factory=list)
    outputs: list[Record] = field(default_factory=list)
    replicas: dict[str, int] = field(default_factory=dict)

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls, cluster: KafkaCluster, pg_dsn: str, *, proxies: list[ThreadedFaultProxy] | None = None
    ) -> AsyncIterator[FaultRun]:
        """Start the flows (through ``proxies`` if given); afterwards read the input and output back."""
        await prepare(pg_dsn, [(TAG, 1000)])
        bootstrap = cluster.bootstrap
        topic_in, topic_out = unique("ha8.raw"), unique("ha8.enriched")
        # The product's group sessions where faults are hangs (see the test's docstring).
        sessions = (
            {}
            if proxies is None
            else {
                "kafka_session_timeout_ms": KafkaConfig().session_timeout_ms,
                "kafka_heartbeat_interval_ms": KafkaConfig().heartbeat_interval_ms,
            }
        )
        config = kafka_config(
            # The test's own clients (the feeder, the readers) go straight to the brokers.
            bootstrap if proxies is None else cluster.proxied_bootstrap,
            pg_dsn,
            kafka_enabled=True,
            kafka_request_topic=unique("ha8.requests"),
            kafka_reply_topic=unique("ha8.replies"),
            kafka_group_id=unique("ha8.serve"),
            **sessions,
        )
        settings = EnrichSettings(
            input_topic=topic_in,
            output_topic=topic_out,
            tag=TAG,
            placement=Placement.from_options(field="order.id"),
            group_id=unique("ha8.enrich"),
            commit_records=100,
        )
        # The coordinator of the enricher's transactions (asking creates Kafka's transaction log if need
        # be) leads input partition 0, another broker partition 1.
        victim = cluster.transaction_coordinator(settings.transactional_id(0))
        others = [m.node_id for m in cluster.members if m is not victim]
        await create_placed_topic(bootstrap, topic_in, [[victim.node_id, *others], [*others, victim.node_id]])
        topics = [
            topic_in,
            topic_out,
            settings.dlq,
            config.kafka.request_topic,
            str(config.kafka.reply_topic),
        ]
        stop = asyncio.Event()
        with restored(cluster):
            async with (
                running_worker(config),
                running_worker(kafka_config(bootstrap, pg_dsn)) as host,
            ):
                enricher = Enricher(config.kafka, settings, host.allocator)
                await enricher.start()
                enriching = asyncio.create_task(enricher.run(stop))
                run: FaultRun | None = None
                try:
                    async with (
                        feeding(bootstrap, topic_in, per_second=400) as failed_sends,
                        TopicReader(bootstrap, topic_out) as out,
                        requesting(config, 4) as seen,
                    ):
                        run = cls(
                            cluster,
                            config,
                            settings,
                            topics,
                            proxies,
                            Progress(lambda: len(out.records)),
                            Progress(lambda: len(seen.answered)),
                            seen,
                            failed_sends,
                        )
                        try:
                            await until(
                                lambda: len(out.records) > 200 and len(seen.answered) > 50,
                                60,
                                "both flows running",
                            )
                            # The dispenser created the output, dead-letter, request and reply topics.
                            await asyncio.to_thread(cluster.wait_in_sync, topics)
                            run.replicas = {t: len(cluster.partition(t).replicas) for t in topics}
                            assert cluster.partition(topic_in, 0).leader == victim.node_id
                            run.placed = victim.node_id
                            yield run
                        finally:
                            # Before anything unwinds: the clients' closes would wait on a hung broker.
                            run.unhang()
                            await run.enriched.close()
                            await run.answered.close()
                    # Every input record, read back from the input topic, must come out exactly once.
                    async with TopicReader(bootstrap, topic_in, committed=False) as source:
                        await source.wait_caught_up(30)
                    run.inputs = source.records
                    async with TopicReader(bootstrap, topic_out) as out_all:
                        run.outputs = await out_all.wait_for(len(run.inputs), timeout=60)
                finally:
                    stop.set()
                    await asyncio.wait_for(enriching, 30)
                    # A killed broker restarts while the output is read back; also before restored() starts it.
                    if run is not None and run.restarting is not None:
                        await run.restarting

    def unhang(self) -> None:
        """Thaw every member and heal every proxy (a no-op when nothing hangs)."""
        for member in self.cluster.members:
            member.thaw()
        for proxy in self.proxies or []:
            proxy.heal()

    async def fault(self, fault: Fault) -> None:
        """Kill, freeze or cut off the enricher's transaction coordinator; wait until both flows grew again."""
        cluster, settings = self.cluster, self.settings
        if self.phases:  # the last fault's broker catches up before the next fault
            if self.restarting is not None:
                await self.restarting
            await asyncio.to_thread(cluster.wait_in_sync, self.topics)
        victim = cluster.transaction_coordinator(settings.transactional_id(0))
        if not self.phases:
            assert victim.node_id == self.placed
        proxy = None if self.proxies is None else self.proxies[cluster.members.index(victim)]
        internal = [*self.topics, "__transaction_state", "__consumer_offsets"]
        led = sorted(
            f"{t}-{p}"
            for (t, p), state in cluster.metadata(internal).partitions.items()
            if state.leader == victim.node_id
        )
        at = time.monotonic()
        if fault == "kill":
            await asyncio.to_thread(victim.kill)
        elif fault == "freeze":
            victim.freeze()
        else:
            assert proxy is not None, "a cut needs the proxies"
            await asyncio.to_thread(proxy.cut, "downstream")
        # A worker starting now creates its topics while the metadata still lists the broker (until its
        # session ends; a cut-off one for ever), and some admin requests go there: they must get through.
        creating = asyncio.create_task(self._create_topics(at))
        if proxy is not None and fault == "cut":
            await asyncio.sleep(CUT_SECONDS)
            await asyncio.to_thread(proxy.heal)
        healed = time.monotonic()
        since = healed if fault == "cut" else at + 0.5
        try:
            await until(
                lambda: self.enriched.grew_since(since) and self.answered.grew_since(since),
                HANG_BOUND if fault == "freeze" else STALL_BOUND,
                f"enrichment and request/reply after the {fault}",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc} of node {victim.node_id} (leading {', '.join(led)}): enrichment grew "
                f"{self.enriched.grew_since(since)}, request/reply grew {self.answered.grew_since(since)}"
            ) from None
        resumed_in = max(self.enriched.resumed(since), self.answered.resumed(since)) - (
            healed if fault == "cut" else at
        )
        created_in = await creating
        # The broker comes back while the flows go on.
        if fault == "kill":
            self.restarting = asyncio.create_task(asyncio.to_thread(cluster.start))
        elif fault == "freeze":
            victim.thaw()
        await asyncio.sleep(2)
        stalls = self.enriched.stall(at), self.answered.stall(at)
        self.phases.append(Phase(fault, victim.node_id, led, resumed_in, stalls, created_in))

    async def _create_topics(self, at: float) -> float:
        for topic in [unique("ha8.late") for _ in range(3)]:
            # [] when an attempt whose answer was lost to a hung broker had created it: it exists either way.
            assert await ensure_topics(self.config.kafka, {topic: 1}) in ([topic], [])
            await asyncio.to_thread(self.cluster.partition, topic)
        return time.monotonic() - at

    def check(self) -> None:
        """Exactly once in the output, no ID twice across both flows, no error that is not retryable."""
        seen = self.seen
        print()
        for phase in self.phases:
            print(phase.describe())
        print(
            f"{len(self.inputs)} records in, {len(self.outputs)} out; request/reply {len(seen.answered)} "
            f"answers, {seen.timeouts} timeouts, {seen.send_errors} send errors, error replies "
            f"{dict(seen.errors)}; {self.failed_sends[0]} failed input sends"
        )
        assert self.replicas == dict.fromkeys(self.topics, 3), self.replicas
        sources = Counter(source_of(r) for r in self.outputs)
        twice = [s for s, n in sources.items() if n > 1]
        assert not twice, f"{len(twice)} input records enriched more than once, e.g. {twice[:5]}"
        assert len(self.inputs) > 200
        assert set(sources) == {(r.partition, r.offset) for r in self.inputs}
        ids = [json.loads(r.value or b"")["order"]["id"] for r in self.outputs] + [
            i for _, got in seen.answered for i in got
        ]
        assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} IDs handed out twice"
        assert seen.not_retryable == []
