"""The cluster harness itself: members route to each other, one ZooKeeper leads, Kafka replicates three ways."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg

from dispenser.adapters.kafka.connection import ensure_topics
from dispenser.config import KafkaConfig
from dispenser_lab.servers import KafkaCluster, NatsCluster, ZooKeeperEnsemble
from tests.integration.kafka_support import unique

pytestmark = pytest.mark.ha


async def test_nats_members_route_requests_between_them(nats_cluster: NatsCluster) -> None:
    async def answer(msg: Msg) -> None:
        await msg.respond(b"pong")

    first = await nats.connect(nats_cluster.urls[0])
    last = await nats.connect(nats_cluster.urls[-1])
    try:
        await first.subscribe("harness.ping", cb=answer)
        await first.flush()
        # Interest crosses the route a moment after the subscription: until then, "no responders".
        for _ in range(100):
            try:
                reply = await last.request("harness.ping", b"", timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        assert reply.data == b"pong"
        assert first.connected_url is not None
        assert first.connected_url.port is not None
        assert nats_cluster.member_at(first.connected_url.port) is nats_cluster.member(1)
    finally:
        await first.close()
        await last.close()
    assert all(len(nats_cluster.routes(n)) == 2 for n in (1, 2, 3))


def test_zookeeper_ensemble_has_one_leader(zk_ensemble: ZooKeeperEnsemble) -> None:
    leader = zk_ensemble.leader()
    modes = zk_ensemble.modes()
    assert sorted(str(m) for m in modes.values()) == ["follower", "follower", "leader"], modes
    assert zk_ensemble.hosts.count(",") == 2
    assert zk_ensemble.member_at(leader.port) is leader


async def test_kafka_topics_replicate_on_all_three(kafka_cluster: KafkaCluster) -> None:
    """The dispenser's default replication factor on three brokers is 3; a configured one is used as is."""
    topic, two = unique("harness"), unique("harness-rf2")
    await ensure_topics(KafkaConfig(bootstrap_servers=kafka_cluster.bootstrap), {topic: 1})
    await ensure_topics(
        KafkaConfig(bootstrap_servers=kafka_cluster.bootstrap, replication_factor=2), {two: 1}
    )
    assert len(kafka_cluster.partition(two).replicas) == 2
    kafka_cluster.wait_in_sync([topic])
    state = kafka_cluster.partition(topic)
    assert sorted(state.replicas) == [1, 2, 3]
    assert sorted(state.isr) == [1, 2, 3]
    assert kafka_cluster.leader_of(topic).node_id == state.leader
    assert kafka_cluster.transaction_coordinator(unique("txn")).running
    assert kafka_cluster.bootstrap.count(",") == 2
