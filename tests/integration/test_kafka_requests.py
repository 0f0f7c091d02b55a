"""ID requests over Kafka topics against a real broker: replies, errors, Spring's headers, workers sharing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from dispenser.adapters.kafka.connection import CORRELATION_ID, REPLY_PARTITION, REPLY_TOPIC, encode_partition
from dispenser.app import Worker
from dispenser.client import IdRequestError, KafkaIdClient
from dispenser.config import Config
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import TopicReader, create_topics, kafka_config, produce, unique
from .segment_support import prepare

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[Worker]:
    """A Kafka-only worker in this event loop."""
    async with Worker(config) as worker:
        yield worker


def topics_config(bootstrap: str, dsn: str | None, **settings: object) -> Config:
    """A Kafka-enabled worker config with request and reply topics of its own."""
    return kafka_config(
        bootstrap,
        dsn,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
        rate_interval=0.5,
        rate_kafka_topic=unique("rate"),
        **settings,
    )


@pytest.fixture
async def worker(kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path) -> AsyncIterator[Worker]:
    """A worker serving segment tag ``order`` (step 100) and snowflake IDs over Kafka."""
    await prepare(pg_dsn, [("order", 100)])
    config = topics_config(
        kafka_broker.bootstrap, pg_dsn, snowflake_enabled=True, snowflake_state_dir=tmp_path
    )
    async with serving(config) as running:
        yield running


@pytest.fixture
async def client(worker: Worker) -> AsyncIterator[KafkaIdClient]:
    """A client of ``worker``'s topics."""
    async with KafkaIdClient(worker.config.kafka, timeout=20.0) as kafka_client:
        yield kafka_client


async def test_ids_and_ranges_of_a_segment_tag(client: KafkaIdClient) -> None:
    """``ids`` gives a list, ``ranges`` inclusive pairs; a batch over the step spans segments; all unique."""
    first = await client.ids("order", 5)
    assert len(first) == 5
    assert first == sorted(first)
    ranges = await client.ranges("order", 250)
    assert sum(last - f + 1 for f, last in ranges) == 250
    more = [i for f, last in ranges for i in range(f, last + 1)]
    assert not set(first) & set(more)
    assert min(more) > max(first)


async def test_snowflake_ids_over_kafka(client: KafkaIdClient) -> None:
    """``kind: snowflake`` is answered by the snowflake generator of the same worker."""
    ids = await client.ids("anything", 100, kind="snowflake")
    assert len(set(ids)) == 100
    assert ids == sorted(ids)
    assert min(ids) > 2**40  # a time-based ID, not a segment's small numbers


async def test_msgpack_requests_get_msgpack_replies(worker: Worker) -> None:
    """With ``content-type: application/msgpack`` the request and the reply are msgpack."""
    async with KafkaIdClient(worker.config.kafka, msgpack=True, timeout=20.0) as kafka_client:
        reply = await kafka_client.request("order", 3)
    assert reply.error is None
    assert reply.ids is not None
    assert len(reply.ids) == 3


async def test_a_retry_with_the_same_request_id_gets_the_same_ids(client: KafkaIdClient) -> None:
    """``request_id`` makes a retry idempotent over Kafka too."""
    first = await client.ids("order", 10, request_id="r-1")
    again = await client.ids("order", 10, request_id="r-1")
    assert first == again


@pytest.mark.parametrize(
    ("tag", "options", "code", "retryable"),
    [
        ("nope", {}, "unknown_tag", False),
        ("bad tag!", {}, "invalid_tag", False),
        ("order", {"count": 0}, "invalid_count", False),
        ("order", {"count": 10_001}, "count_too_large", False),
    ],
)
async def test_errors_are_replies_with_codes(
    client: KafkaIdClient, tag: str, options: dict[str, int], code: str, retryable: bool
) -> None:
    """Unknown and invalid tags and bad counts come back as error replies with the NATS codes."""
    with pytest.raises(IdRequestError) as caught:
        await client.ids(tag, **options)
    assert caught.value.code == code
    assert caught.value.retryable is retryable
    assert caught.value.message


async def raw_request(
    worker: Worker,
    body: bytes,
    *,
    key: bytes | None = b"order",
    headers: list[tuple[str, bytes]] | None = None,
) -> tuple[dict[str, object], list[tuple[str, bytes]]]:
    """Send a hand-made request record; return the decoded reply and its headers."""
    kafka = worker.config.kafka
    assert kafka.reply_topic is not None
    correlation = b"\x00\x01corr\xff"
    sent_headers = headers if headers is not None else [(REPLY_TOPIC, kafka.reply_topic.encode())]
    async with TopicReader(kafka.bootstrap_servers, kafka.reply_topic) as replies:
        await produce(
            kafka.bootstrap_servers,
            kafka.request_topic,
            [(0, key, body, [*sent_headers, (CORRELATION_ID, correlation)])],
        )
        (record,) = await replies.wait_for(1, timeout=20)
    assert record.header(CORRELATION_ID) == correlation  # copied byte for byte
    return json.loads(record.value or b""), record.headers


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "malformed"),
        (b'{"count": "many"}', "invalid"),
        (b'{"cuont": 3}', "invalid"),
        (b'{"kind": "uuid"}', "invalid"),
        (b'{"count": 1, "pad": "' + b"x" * 5000 + b'"}', "too_large"),
    ],
)
async def test_bad_bodies_get_error_replies_and_the_worker_keeps_serving(
    worker: Worker, client: KafkaIdClient, body: bytes, code: str
) -> None:
    """A body that is not a valid request is answered with its error code (and a header saying it)."""
    reply, headers = await raw_request(worker, body)
    assert reply["tag"] == "order"  # the key names the tag when the body can't
    error = reply["error"]
    assert isinstance(error, dict)
    assert error["code"] == code
    assert ("leaf-error-code", code.encode()) in headers
    assert len(await client.ids("order", 2)) == 2


async def test_the_tag_comes_from_the_key_when_the_body_is_empty(worker: Worker) -> None:
    """Records are keyed by tag: an empty body asks for one ID of the key's tag."""
    reply, _ = await raw_request(worker, b"")
    assert reply["tag"] == "order"
    assert isinstance(reply["ids"], list)
    assert len(reply["ids"]) == 1


async def test_a_request_without_reply_topic_header_goes_to_the_default_reply_topic(worker: Worker) -> None:
    """Without ``kafka_replyTopic`` the reply goes to ``kafka.reply_topic``."""
    reply, _ = await raw_request(worker, b'{"count": 2}', headers=[])
    assert isinstance(reply["ids"], list)
    assert len(reply["ids"]) == 2


async def test_a_kind_the_worker_does_not_serve_is_an_error(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """A segment-only worker answers ``kind: snowflake`` with ``kind_not_served``."""
    await prepare(pg_dsn, [("order", 100)])
    async with (
        serving(topics_config(kafka_broker.bootstrap, pg_dsn)) as running,
        KafkaIdClient(running.config.kafka, timeout=20.0) as kafka_client,
    ):
        with pytest.raises(IdRequestError) as caught:
            await kafka_client.ids("order", kind="snowflake")
        assert caught.value.code == "kind_not_served"


async def test_no_reply_topic_anywhere_is_logged_and_counted(
    kafka_broker: KafkaBroker, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """No header and no configured default: nothing is produced, the drop is counted and logged."""
    config = topics_config(kafka_broker.bootstrap, None, snowflake_enabled=True, snowflake_state_dir=tmp_path)
    config.kafka.reply_topic = ""
    async with serving(config) as running:
        await produce(kafka_broker.bootstrap, config.kafka.request_topic, [(0, b"t", b"", [])])
        for _ in range(200):
            if running.kafka.stats.no_reply_topic:
                break
            await asyncio.sleep(0.1)
        assert running.kafka.stats.no_reply_topic == 1
        assert running.kafka.stats.replies == 0
    assert "no kafka_replyTopic header" in caplog.text


async def test_replies_go_to_the_requested_partition(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """A reply topic with 3 partitions: ``kafka_replyPartition`` (Spring's 4-byte int) picks the partition."""
    await prepare(pg_dsn, [("order", 100)])
    config = topics_config(kafka_broker.bootstrap, pg_dsn)
    assert config.kafka.reply_topic is not None
    await create_topics(kafka_broker.bootstrap, {config.kafka.reply_topic: 3})
    async with (
        serving(config),
        KafkaIdClient(config.kafka, reply_partition=2, timeout=20.0) as kafka_client,
        TopicReader(kafka_broker.bootstrap, config.kafka.reply_topic) as replies,
    ):
        for _ in range(3):
            assert len(await kafka_client.ids("order", 1)) == 1
        records = await replies.wait_for(3, timeout=20)
    assert {r.partition for r in records} == {2}
    assert all(r.header(CORRELATION_ID) for r in records)
    assert encode_partition(2) == b"\x00\x00\x00\x02"
    assert REPLY_PARTITION == "kafka_replyPartition"


async def test_two_workers_in_one_group_share_the_partitions(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """Four request partitions, two workers: both answer, and no ID of a tag is handed out twice."""
    tags = [f"t{i}" for i in range(8)]
    await prepare(pg_dsn, [(tag, 50) for tag in tags])
    config = topics_config(kafka_broker.bootstrap, pg_dsn)
    await create_topics(kafka_broker.bootstrap, {config.kafka.request_topic: 4})
    async with serving(config) as first, serving(config) as second:
        async with KafkaIdClient(config.kafka, timeout=30.0) as kafka_client:
            # Wait until the group has settled on both members.
            for _ in range(100):
                if first.kafka.assignment() and second.kafka.assignment():
                    break
                await asyncio.sleep(0.1)
            replies = await asyncio.gather(*(kafka_client.ids(tag, 7) for _ in range(20) for tag in tags))
        served = (first.kafka.stats.replies, second.kafka.stats.replies)
    everything = [i for ids in replies for i in ids]
    assert len(everything) == 20 * len(tags) * 7
    per_tag: dict[int, list[int]] = {}
    for n, ids in enumerate(replies):
        per_tag.setdefault(n % len(tags), []).extend(ids)
    for ids in per_tag.values():
        assert len(set(ids)) == len(ids)
    assert all(n > 0 for n in served), served


async def test_broker_down_while_serving_then_back(private_kafka: KafkaBroker, pg_dsn: str) -> None:
    """The broker stops while requests come in: the worker survives and answers all once it is back.

    Clients retry with the same ``request_id``; no ID is handed out twice.
    """
    await prepare(pg_dsn, [("order", 100)])
    config = topics_config(private_kafka.bootstrap, pg_dsn)
    async with serving(config) as running, KafkaIdClient(config.kafka, timeout=60.0) as kafka_client:
        before = [await kafka_client.ids("order", 3, request_id=f"before-{n}") for n in range(3)]
        private_kafka.stop()

        async def ask_with_retries(n: int) -> list[int]:
            for _ in range(6):  # same request_id: a retry gets the same IDs, not new ones
                with contextlib.suppress(TimeoutError, OSError):
                    return await kafka_client.ids("order", 3, request_id=f"during-{n}", timeout=15.0)
            raise AssertionError(f"request {n} never answered")

        during = asyncio.gather(*(ask_with_retries(n) for n in range(10)))
        await asyncio.sleep(3)
        assert running.kafka.alive()
        private_kafka.start()
        answered = await during
        after = await kafka_client.ids("order", 3)
    everything = [i for ids in [*before, *answered, after] for i in ids]
    assert len(everything) == 14 * 3
    assert len(set(everything)) == len(everything)


async def test_a_request_the_hung_broker_never_acknowledges_fails_at_the_request_timeout(
    private_kafka: KafkaBroker, pg_dsn: str
) -> None:
    """The broker freezes: a request fails with OSError once ``kafka.request_timeout_ms`` (1 s here) passes.

    Not at the client's own timeout (30 s), and not with a "Future exception was never retrieved" logged
    when the failed delivery is collected (seen in the soak's output before).
    """
    await prepare(pg_dsn, [("order", 100)])
    config = topics_config(private_kafka.bootstrap, pg_dsn, kafka_request_timeout_ms=1000)
    async with serving(config), KafkaIdClient(config.kafka, timeout=30.0) as kafka_client:
        assert len(await kafka_client.ids("order", 3)) == 3  # the request topic's leader is known
        private_kafka.freeze()
        try:
            began = time.monotonic()
            with pytest.raises(OSError, match="could not send the request"):
                await kafka_client.ids("order", 3)
            failed_in = time.monotonic() - began
        finally:
            private_kafka.thaw()
        assert len(await kafka_client.ids("order", 3)) == 3  # thawed: served again
    assert failed_in < 15, failed_in


async def test_rate_events_go_to_the_kafka_topic_keyed_by_tag(worker: Worker, client: KafkaIdClient) -> None:
    """With Kafka on, each tag's rate events also go to the rate topic, keyed by tag, in the event schema."""
    from dispenser.messages import RateEvent  # noqa: PLC0415

    await client.ids("order", 50)
    kafka = worker.config.kafka
    async with TopicReader(kafka.bootstrap_servers, worker.config.rate.kafka_topic) as events:
        records = await events.wait_for(2, timeout=30)
    order = [r for r in records if r.key == b"order"]
    assert order
    event = msgspec.json.decode(order[-1].value or b"", type=RateEvent)
    assert (event.tag, event.kind) == ("order", "segment")
    assert event.ids_total >= 50


async def test_the_kafka_request_schema_is_what_the_client_sends() -> None:
    """The client's request body decodes as the published KafkaIdRequest."""
    from dispenser.messages import KafkaIdRequest, decode_kafka_request  # noqa: PLC0415

    body = msgspec.json.encode(KafkaIdRequest(tag="order", kind="snowflake", count=3))
    decoded = decode_kafka_request(body)
    assert (decoded.tag, decoded.kind, decoded.count) == ("order", "snowflake", 3)
