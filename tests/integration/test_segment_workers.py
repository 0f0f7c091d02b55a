"""Several worker processes, crashes and shutdowns: no ID is ever handed out twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path

import pytest
from nats.aio.client import Client

from dispenser_lab.servers import NatsServer

from .segment_support import WorkerProcess, ask, client, ids_of, prepare, wait_serving

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]

SUBJECT = "leaf.segment.demo"


async def requests_per_worker(nc: Client) -> list[int]:
    """Ask every worker for its $SRV.STATS (not a queue group: all answer) and sum its requests."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.STATS.leaf-dispenser", b"", reply=inbox)
    counts = []
    with contextlib.suppress(TimeoutError):
        while True:
            msg = await sub.next_msg(timeout=1.0)
            stats = json.loads(msg.data)
            counts.append(sum(e["num_requests"] for e in stats["endpoints"]))
    await sub.unsubscribe()
    return counts


async def test_two_workers_and_concurrent_clients_draw_a_million_unique_ids(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Two worker processes in one queue group; 8 clients draw 1,000,000+ IDs; all unique, both serve."""
    await prepare(pg_dsn, [("demo", 5000)])
    workers = [WorkerProcess(nats_server.url, pg_dsn, tmp_path / f"worker{i}.log") for i in range(2)]
    for worker in workers:
        worker.start()
    try:
        async with client(nats_server.url) as probe:
            for worker in workers:
                await worker.wait_ready(probe, SUBJECT)
            await wait_serving(probe, 2)

        async def draw(requests: int, body: bytes) -> list[int]:
            ids: list[int] = []
            async with client(nats_server.url) as nc:
                for _ in range(requests):
                    ids += ids_of(await ask(nc, SUBJECT, body))
            return ids

        per_client = await asyncio.gather(
            *(draw(125, b'{"count": 1000}') for _ in range(6)),  # 750,000 as ids
            *(draw(25, b'{"count": 5000, "format": "ranges"}') for _ in range(2)),  # 250,000 as ranges
        )
        everything = [i for ids in per_client for i in ids]
        assert len(everything) == 1_000_000
        assert len(set(everything)) == len(everything)
        assert min(everything) >= 1
        async with client(nats_server.url) as nc:
            served = await requests_per_worker(nc)
        assert len(served) == 2
        assert all(n > 0 for n in served), served  # the queue group spread the load over both
    finally:
        for worker in workers:
            worker.stop()
    logs = [w.log_path.read_text() for w in workers]
    for text in logs:
        assert "Traceback" not in text


async def test_sigkill_and_restart_never_reissues(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """A worker killed with SIGKILL and restarted hands out only IDs above everything it issued."""
    await prepare(pg_dsn, [("demo", 1000)])
    worker = WorkerProcess(nats_server.url, pg_dsn, tmp_path / "worker.log")
    issued: list[int] = []
    try:
        async with client(nats_server.url) as nc:
            worker.start()
            await worker.wait_ready(nc, SUBJECT)
            for _ in range(3):
                issued += ids_of(await ask(nc, SUBJECT, b'{"count": 450}'))
            worker.signal(signal.SIGKILL)
            assert worker.wait() == -signal.SIGKILL
            worker.start()
            await worker.wait_ready(nc, SUBJECT)
            after = ids_of(await ask(nc, SUBJECT, b'{"count": 100}'))
    finally:
        worker.stop()
    # wait_ready's probes took IDs too, so compare against everything we saw ourselves.
    assert min(after) > max(issued)
    assert len(set(issued + after)) == len(issued) + len(after)


async def test_sigterm_answers_requests_in_flight(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """SIGTERM while requests are in flight: each gets a reply, and the worker exits 0."""
    await prepare(pg_dsn, [("demo", 100)])
    worker = WorkerProcess(nats_server.url, pg_dsn, tmp_path / "worker.log")
    try:
        async with client(nats_server.url) as nc:
            worker.start()
            await worker.wait_ready(nc, SUBJECT)
            requests = [asyncio.ensure_future(ask(nc, SUBJECT, b'{"count": 60}')) for _ in range(200)]
            # Let every request be published before the signal: one turn of the loop is not always enough
            # for 200 of them on a loaded machine (the late ones then met a drained worker: no responders).
            for _ in range(20):
                await asyncio.sleep(0)
            await nc.flush()
            worker.signal(signal.SIGTERM)
            replies = await asyncio.gather(*requests, return_exceptions=True)
            assert await asyncio.to_thread(worker.wait) == 0
    finally:
        worker.stop()
    answered = [r for r in replies if not isinstance(r, BaseException)]
    assert len(answered) == len(replies), [r for r in replies if isinstance(r, BaseException)][:3]
    ids = [i for r in answered for i in ids_of(r)]
    assert len(set(ids)) == len(ids)
    assert "stopped" in worker.log_path.read_text()


async def test_sigusr1_writes_every_threads_stack_and_the_worker_goes_on(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """``kill -USR1``: every thread's stack in the log (the event loop's too), and the worker keeps serving."""
    await prepare(pg_dsn, [("demo", 100)])
    worker = WorkerProcess(nats_server.url, pg_dsn, tmp_path / "worker.log")
    try:
        async with client(nats_server.url) as nc:
            worker.start()
            await worker.wait_ready(nc, SUBJECT)
            worker.signal(signal.SIGUSR1)
            deadline = asyncio.get_running_loop().time() + 10
            while "Current thread" not in worker.log_path.read_text():
                assert asyncio.get_running_loop().time() < deadline, worker.log_path.read_text()[-3000:]
                await asyncio.sleep(0.05)
            reply = await ask(nc, SUBJECT, b'{"count": 5}')
            assert len(ids_of(reply)) == 5
    finally:
        worker.stop()
    log = worker.log_path.read_text()
    # The main thread runs the event loop (uvloop's, in C): its stack ends in our runner.
    assert "in run_async" in log, log[-3000:]
