"""The buffered client against real workers (NATS, PostgreSQL, Kafka): uniqueness, outages, threads, retries."""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest

from dispenser.adapters.nats.client_transport import NatsIdTransport
from dispenser.client import BlockingIdClient, BufferSettings, DispenserUnavailable, IdClient, IdRequestError
from dispenser.config import NatsConfig
from dispenser.messages import IdRequest, Kind, Reply
from dispenser_lab.servers import KafkaBroker, NatsServer

from .kafka_support import unique
from .segment_support import (
    WorkerProcess,
    ask,
    client,
    prepare,
    running_worker,
    wait_serving,
    wait_until,
    worker_config,
)
from .test_segment_workers import requests_per_worker

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

SUBJECT = "leaf.segment.demo"
QUICK = BufferSettings(retry_initial=0.01, retry_max=0.2)


class Runs:
    """A client's IDs kept as runs of consecutive IDs (``[first, last]``), checked to increase as they come."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []
        self.count = 0

    def add(self, first: int, last: int) -> None:
        """Record IDs ``first..last``, which must lie above every ID recorded before."""
        if self.runs:
            assert first > self.runs[-1][1], (first, self.runs[-1])
            if first == self.runs[-1][1] + 1:
                self.runs[-1][1] = last
                self.count += last - first + 1
                return
        self.runs.append([first, last])
        self.count += last - first + 1


def assert_disjoint(clients: list[Runs]) -> None:
    """No ID in two clients' runs."""
    runs = sorted((first, last) for c in clients for first, last in c.runs)
    for (_, last), (first, _) in itertools.pairwise(runs):
        assert first > last, (last, first)


def held_ids(ids: IdClient) -> int:
    """IDs of ``demo`` the client holds."""
    stats = ids.stats("demo")
    return 0 if stats is None else stats.ids_held


class CountingTransport(NatsIdTransport):
    """The NATS transport, counting requests; it may lose the next replies after they arrived."""

    def __init__(self, url: str) -> None:
        super().__init__(NatsConfig(url=url))
        self.sent: list[IdRequest] = []
        self.lost: list[Reply] = []
        self.lose = 0

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Send; when ``lose`` is set, keep the reply and raise as if it never came."""
        self.sent.append(request)
        reply = await super().request(kind, tag, request, timeout)
        if self.lose:
            self.lose -= 1
            self.lost.append(reply)
            raise TimeoutError("reply lost (the test dropped it)")
        return reply


@pytest.mark.slow
async def test_eight_clients_draw_a_million_ids_each_through_a_worker_kill_and_restart(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """8 clients x 1,000,000 IDs from two worker processes, one SIGKILLed and restarted meanwhile: all unique."""
    await prepare(pg_dsn, [("demo", 10_000)])
    workers = [WorkerProcess(nats_server.url, pg_dsn, tmp_path / f"worker{i}.log") for i in range(2)]
    for worker in workers:
        worker.start()
    per_client = 1_000_000
    clients = [Runs() for _ in range(8)]
    progress = [0] * 8
    retries = [0]
    restarted = asyncio.Event()
    # Small ranges (50,000): refills every few milliseconds, so some are in flight at the worker when it dies.
    settings = BufferSettings(max_buffer=50_000, retry_initial=0.01, retry_max=0.2)
    try:
        async with client(nats_server.url) as probe:
            for worker in workers:
                await worker.wait_ready(probe, SUBJECT)

            async def draw(n: int, runs: Runs, ids: IdClient) -> None:
                # Half the clients one ID at a time, half in batches of 1,000 as ranges.
                while runs.count < per_client or not restarted.is_set():
                    try:
                        if n % 2:
                            for _ in range(10_000):
                                i = await ids.next_id("demo")
                                runs.add(i, i)
                        else:
                            for first, last in await ids.take("demo", 1000, format="ranges"):
                                runs.add(first, last)
                    except DispenserUnavailable:  # the buffer ran dry while a refill was being retried
                        retries[0] += 1
                        await asyncio.sleep(0.01)
                    progress[n] = runs.count
                    await asyncio.sleep(0)  # let the other clients (and the refills) run

            async def killer() -> None:
                await wait_until(lambda: sum(progress) >= 2_000_000, what="2,000,000 IDs drawn", timeout=60)
                workers[0].signal(signal.SIGKILL)
                await asyncio.to_thread(workers[0].wait)
                workers[0].start()
                await workers[0].wait_ready(probe, SUBJECT)
                restarted.set()

            ids_clients = [IdClient.over_nats(nats_server.url, settings) for _ in range(8)]
            for ids in ids_clients:
                await ids.start()
            started = time.monotonic()
            try:
                await asyncio.gather(
                    killer(),
                    *(
                        draw(n, runs, ids)
                        for n, (runs, ids) in enumerate(zip(clients, ids_clients, strict=True))
                    ),
                )
                elapsed = time.monotonic() - started
                stats = [ids.stats("demo") for ids in ids_clients]
                served = await requests_per_worker(probe)
            finally:
                for ids in ids_clients:
                    await ids.close()
            async with IdClient.over_nats(nats_server.url, QUICK) as late:
                after = Runs()
                for first, last in await late.take("demo", 5000, format="ranges"):
                    after.add(first, last)
    finally:
        for worker in workers:
            worker.stop()
    assert all(c.count >= per_client for c in clients)
    assert_disjoint([*clients, after])
    requests = sum(s.requests for s in stats if s is not None)
    handed_out = sum(c.count for c in clients)
    print(f"{handed_out:,} IDs in {elapsed:.1f} s, {requests} requests, {retries[0]} empty, served {served}")
    assert requests < handed_out / 10_000  # a request per ID would be 8,000,000
    assert "Traceback" not in workers[1].log_path.read_text()


async def test_an_outage_serves_the_buffer_raises_then_recovers(nats_server: NatsServer, pg_dsn: str) -> None:
    """Workers gone: held IDs are handed out, then DispenserUnavailable; a new worker and the client recovers."""
    await prepare(pg_dsn, [("demo", 1000)])
    config = worker_config(nats_server.url, pg_dsn)
    settings = BufferSettings(min_buffer=500, max_buffer=500, retry_initial=0.01, retry_max=0.1)
    async with IdClient.over_nats(nats_server.url, settings) as ids:
        async with running_worker(config), client(nats_server.url) as nc:
            # nats-server may answer "no responders" for a few ms after the worker's SUB (see
            # segment_support.request), which the client rightly takes for an outage: ask once first.
            await ask(nc, "leaf.segment.demo", b'{"count": 1}')
            before = [await ids.next_id("demo") for _ in range(10)]
            await wait_until(lambda: held_ids(ids) == 990, what="the second range")
        held: list[int] = []
        with pytest.raises(DispenserUnavailable) as caught:  # noqa: PT012 - the loop is the point
            while True:
                held.append(await ids.next_id("demo"))
        assert caught.value.retryable
        assert caught.value.code in {"unreachable", "timeout"}
        assert len(held) == 1000 - 10  # both ranges handed out first
        with pytest.raises(DispenserUnavailable):
            await ids.take("demo", 5)
        async with running_worker(config):
            deadline = time.monotonic() + 10
            while True:
                try:
                    after = await ids.next_id("demo")
                    break
                except DispenserUnavailable:
                    assert time.monotonic() < deadline, "the client did not recover"
                    await asyncio.sleep(0.02)
    seen = [*before, *held, after]
    assert all(a < b for a, b in itertools.pairwise(seen))


async def test_two_workers_whose_segments_interleave_leave_the_client_its_buffer_only(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Issue 30: ranges from two workers interleave; the client holds about its settings' two ranges, no more.

    The workers draw segments of 10,000 from one row, so one is 10,000 ahead of the other; the client's ranges
    are 100. A reply from the one behind lies below the IDs held and is skipped, and the next request asks for
    the gap on top, to pass it in one request; answered by the one ahead, the whole of it used to be held
    (about 10,000 IDs, a hundred of this client's ranges). Once the workers stop, the client hands out what
    it holds and raises: about its buffer, whichever worker answered what.
    """
    await prepare(pg_dsn, [("demo", 10_000)])
    config = worker_config(nats_server.url, pg_dsn)
    config = msgspec.structs.replace(config, rate=msgspec.structs.replace(config.rate, adaptive_step=False))
    settings = BufferSettings(min_buffer=100, max_buffer=100, retry_initial=0.01, retry_max=0.1)
    bound = 3 * settings.max_buffer  # the range in use, the next one, and the one arriving
    most = 0
    async with IdClient.over_nats(nats_server.url, settings) as ids:
        async with running_worker(config), running_worker(config), client(nats_server.url) as nc:
            await wait_serving(nc, 2)
            await ask(
                nc, SUBJECT, b'{"count": 1}'
            )  # past nats-server's first "no responders" (see test above)
            seen = []
            for _ in range(5_000):  # 50 ranges
                seen.append(await ids.next_id("demo"))
                most = max(most, held_ids(ids))
            stats = ids.stats("demo")
        held: list[int] = []
        with pytest.raises(DispenserUnavailable):  # noqa: PT012 - the loop is the point
            while True:
                held.append(await ids.next_id("demo"))
    assert stats is not None
    assert stats.ids_dropped > 0  # the workers' ranges did interleave
    assert most <= bound, f"held {most:,} IDs, ranges of {settings.max_buffer}"
    assert len(held) <= bound
    assert all(a < b for a, b in itertools.pairwise([*seen, *held]))


async def test_unknown_tag_and_bad_request_raise_the_coded_error_once(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """unknown_tag and invalid_tag reach the caller as coded, non-retryable errors: at most one request per call.

    A bad tag name is refused by the client itself, as a worker would, with no request at all.
    """
    await prepare(pg_dsn, [("demo", 1000)])
    transport = CountingTransport(nats_server.url)
    async with running_worker(worker_config(nats_server.url, pg_dsn)), IdClient(transport, QUICK) as ids:
        with pytest.raises(IdRequestError) as unknown:
            await ids.next_id("nope")
        assert (unknown.value.code, unknown.value.retryable) == ("unknown_tag", False)
        with pytest.raises(IdRequestError) as bad:
            await ids.take("x" * 129, 3)
        assert (bad.value.code, bad.value.retryable) == ("invalid_tag", False)
        await asyncio.sleep(0.3)  # time enough for a retry storm, were there one
        assert len(transport.sent) == 1  # "nope" only


async def test_a_refill_retried_after_a_lost_reply_gets_the_same_range(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """The reply to a refill is lost; the retry carries the same request_id and the fleet answers the same range."""
    await prepare(pg_dsn, [("demo", 1000)])
    transport = CountingTransport(nats_server.url)
    transport.lose = 1
    async with running_worker(worker_config(nats_server.url, pg_dsn)), IdClient(transport, QUICK) as ids:
        first = await ids.next_id("demo")
    assert transport.sent[0].request_id == transport.sent[1].request_id
    assert transport.lost[0].ranges is not None
    assert transport.lost[0].ranges[0][0] == first  # the lost range is the one handed out: nothing burnt


async def test_the_blocking_client_from_sixteen_threads(nats_server: NatsServer, pg_dsn: str) -> None:
    """Sixteen threads share one BlockingIdClient against a real worker: every ID once, increasing per thread."""
    await prepare(pg_dsn, [("demo", 1000)])
    per_thread = [Runs() for _ in range(16)]
    errors: list[BaseException] = []
    async with running_worker(worker_config(nats_server.url, pg_dsn)):
        blocking = BlockingIdClient.over_nats(nats_server.url, QUICK)
        await asyncio.to_thread(blocking.start)

        def work(runs: Runs) -> None:
            try:
                for n in range(20_000):
                    if n % 500 == 0:
                        for first, last in blocking.take("demo", 100, format="ranges"):
                            runs.add(first, last)
                    else:
                        i = blocking.next_id("demo")
                        runs.add(i, i)
            except BaseException as exc:
                errors.append(exc)
                raise

        threads = [threading.Thread(target=work, args=(runs,)) for runs in per_thread]
        for thread in threads:
            thread.start()
        # The worker runs in this loop: wait without blocking it.
        await wait_until(
            lambda: not any(t.is_alive() for t in threads), what="the threads' draws", timeout=60
        )
        await asyncio.to_thread(blocking.close)
    assert not errors
    assert all(runs.count == 19_960 + 40 * 100 for runs in per_thread)
    assert_disjoint(per_thread)


@pytest.mark.kafka
async def test_the_same_client_over_kafka(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """IdClient.over_kafka: the same API and buffering through request and reply topics."""
    from .kafka_support import kafka_config  # noqa: PLC0415 - the Kafka helpers only here

    await prepare(pg_dsn, [("demo", 1000)])
    config = kafka_config(
        kafka_broker.bootstrap,
        pg_dsn,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
    )
    settings = BufferSettings(request_timeout=20.0, timeout=30.0)
    async with running_worker(config), IdClient.over_kafka(config.kafka, settings) as ids:
        seen = [await ids.next_id("demo") for _ in range(5000)]
        seen += await ids.take("demo", 20_000)
        with pytest.raises(IdRequestError) as unknown:
            await ids.next_id("nope")
        stats = ids.stats("demo")
    assert unknown.value.code == "unknown_tag"
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert stats is not None
    assert stats.requests < 20
