"""A ``request_id`` retried across a PostgreSQL failover (strict synchronous replication) gets the same IDs.

The first test answers its requests before the kill; the second kills the leader while requests stream to
one worker, some of them with their record in flight, and holds every answer given against the retry.

Two workers on the session's Patroni cluster, each on its own subject prefix so the test chooses who
answers: ``a`` answers a batch of requests with a ``request_id`` before the leader is killed; after the
kill, every one of them is retried on ``b`` (``limits.dedup_unsettled = refuse``, the default: it answers
``unavailable`` until it can read the fleet's record, never other IDs), and gets ``a``'s IDs back. The
record was committed on the synchronous standby before ``a`` replied, so the promoted standby holds it.

The same run shows the first-connection grace (issue 22, item 10): ``a`` is stopped before the kill and
started again after it with its state directory, whose grant memory names the old timeline; its first
fetch on the new primary is held back ``postgres.new_primary_grace`` (a process's first connection used to
fetch at once).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dispenser.config import Config, load_config
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.patroni import PatroniCluster
from tests.integration.segment_support import ask, client, ids_of, prepare, running_worker

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha, pytest.mark.slow]


def config(nats_url: str, dsn: str, prefix: str, state_dir: Path) -> Config:
    return load_config(
        environ={
            "DISPENSER_NATS_URL": nats_url,
            "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
            "DISPENSER_NATS_QUEUE_GROUP": prefix,
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_SEGMENT_STATE_DIR": str(state_dir),
            "DISPENSER_RATE_ENABLED": "false",
        }
    )


async def settled_answer(nc: object, subject: str, body: bytes, within: float) -> tuple[Reply, int]:
    """Ask until an answer with IDs comes (``unavailable`` meanwhile); the answer and how many were refused."""
    refused = 0
    give_up = time.monotonic() + within
    while True:
        reply = await ask(nc, subject, body)  # type: ignore[arg-type]
        if reply.error is None:
            return reply, refused
        assert reply.error.code == "unavailable", reply.error
        refused += 1
        assert time.monotonic() < give_up, f"still {reply.error.message!r} after {within} s"
        await asyncio.sleep(0.1)


async def test_a_request_id_retried_across_a_failover_gets_the_same_ids(
    ha_cluster: PatroniCluster,
    ha_dsn: str,
    nats_server: NatsServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await prepare(ha_dsn, [("order", 1000)])
    url = nats_server.url
    bodies = [f'{{"count": 7, "request_id": "pay-{n}"}}'.encode() for n in range(20)]
    async with running_worker(config(url, ha_dsn, "b", tmp_path / "b")) as b, client(url) as nc:
        async with running_worker(config(url, ha_dsn, "a", tmp_path / "a")) as a:
            first = [await ask(nc, "a.segment.order", body) for body in bodies]
            assert all(reply.error is None for reply in first), [r.error for r in first if r.error]
            assert a.dispatchers["segment"].replays_unsettled == 0  # every answer recorded before the reply
        old = await asyncio.to_thread(ha_cluster.kill_leader)
        new = await asyncio.to_thread(ha_cluster.wait_leader, other_than=old)
        caplog.clear()
        retried = [await settled_answer(nc, "b.segment.order", body, 30.0) for body in bodies]
        assert [ids_of(reply) for reply, _ in retried] == [ids_of(reply) for reply in first]
        assert b.dispatchers["segment"].replays_unsettled == 0
        # `a` again, from its state directory: its memory names the old timeline, so its first connection
        # holds its first fetch back for the grace.
        async with running_worker(config(url, ha_dsn, "a", tmp_path / "a")) as a:
            fresh = await ask(nc, "a.segment.order", b'{"count": 7, "request_id": "pay-new"}')
            assert fresh.error is None
            assert set(ids_of(fresh)).isdisjoint(i for reply in first for i in ids_of(reply))
            again = await ask(nc, "a.segment.order", bodies[0])
            assert ids_of(again) == ids_of(first[0])
    assert "first fetch held back 2.0 s (postgres.new_primary_grace)" in caplog.text
    print(
        f"\nfailover {old.name} -> {new.name}: {len(bodies)} request_ids retried on another worker, same IDs; "
        f"{sum(refused for _, refused in retried)} `unavailable` answers meanwhile"
    )


async def test_answers_in_flight_across_a_failover_are_exact(
    ha_cluster: PatroniCluster, ha_dsn: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The leader killed while 16 requests at a time stream to ``a``, each with a fresh request_id (defaults).

    Every request ``a`` answered with IDs, before, across or after the kill, gets the same IDs when retried
    on ``b`` after the failover; every other one was refused ``unavailable`` (retryable), and its retry gets
    IDs no other request got. Some requests were sent before the kill and answered after it: their record
    was in flight when the leader died.
    """
    await prepare(ha_dsn, [("order", 1_000_000)])
    url = nats_server.url
    answers: dict[str, tuple[float, Reply, float]] = {}  # request_id -> (sent, reply, answered)
    keys = (f"fo-{n}" for n in itertools.count())
    killed_at = float("inf")
    stop = asyncio.Event()

    def body(key: str) -> bytes:
        return f'{{"count": 3, "request_id": "{key}"}}'.encode()

    async def stream(nc: object) -> None:
        while not stop.is_set():
            key = next(keys)
            sent = time.monotonic()
            reply = await ask(nc, "a.segment.order", body(key), timeout=10.0)  # type: ignore[arg-type]
            answers[key] = (sent, reply, time.monotonic())

    async def until(condition: Callable[[], bool], within: float) -> None:
        give_up = time.monotonic() + within
        while not condition():
            assert time.monotonic() < give_up, f"not reached within {within} s"
            await asyncio.sleep(0.05)

    def answered_after_the_kill() -> bool:
        return any(sent > killed_at and reply.error is None for sent, reply, _ in answers.values())

    async with running_worker(config(url, ha_dsn, "b", tmp_path / "b")) as b, client(url) as nc:
        async with running_worker(config(url, ha_dsn, "a", tmp_path / "a")) as a:
            streams = [asyncio.create_task(stream(nc)) for _ in range(16)]
            await until(lambda: len(answers) >= 200, 30.0)
            old = await asyncio.to_thread(ha_cluster.kill_leader)
            killed_at = time.monotonic()
            await asyncio.to_thread(ha_cluster.wait_leader, other_than=old)
            await until(answered_after_the_kill, 60.0)  # `a` serves again on the new primary
            stop.set()
            await asyncio.gather(*streams)
            unsettled = a.dispatchers["segment"].replays_unsettled
        retried: dict[str, Reply] = {}
        ordered = sorted(answers)
        for chunk in (ordered[n : n + 32] for n in range(0, len(ordered), 32)):
            replies = await asyncio.gather(
                *(settled_answer(nc, "b.segment.order", body(key), 30.0) for key in chunk)
            )
            retried |= {key: reply for key, (reply, _) in zip(chunk, replies, strict=True)}
        unsettled += b.dispatchers["segment"].replays_unsettled
    refused = [key for key, (_, reply, _) in answers.items() if reply.error is not None]
    for key, (_, reply, _) in answers.items():
        if reply.error is None:
            assert ids_of(retried[key]) == ids_of(reply), key
        else:
            assert (reply.error.code, reply.error.retryable) == ("unavailable", True), reply.error
    everything = [i for reply in retried.values() for i in ids_of(reply)]
    assert len(set(everything)) == len(everything)
    assert unsettled == 0  # every answer given was recorded first
    across = [key for key, (sent, _, done) in answers.items() if sent < killed_at < done]
    assert across, "no request was in flight when the leader was killed"
    print(
        f"\n{len(answers)} request_ids, {len(across)} in flight at the kill "
        f"({sum(answers[k][1].error is None for k in across)} of them answered with IDs), "
        f"{len(refused)} refused in all; every answer given was the retry's"
    )
