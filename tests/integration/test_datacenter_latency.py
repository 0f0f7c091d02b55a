"""A worker in datacenter B fetching from a primary in A (20 ms each way): what a fetch costs, and that requests do not pay it.

The datacenter boundary is the test kit's :class:`~dispenser_lab.faultproxy.FaultProxy` between the worker
and PostgreSQL, adding 20 ms each way. One PostgreSQL stands for the primary in A; the synchronous standby's acknowledgement (a
second crossing per commit with ``pg-b1`` synchronous, docs/datacenters.md) is not modelled here.
"""

from __future__ import annotations

import statistics
import time
from urllib.parse import urlsplit, urlunsplit

import msgspec
import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.config import load_config
from dispenser.messages import Reply
from dispenser_lab.faultproxy import FaultProxy
from dispenser_lab.servers import NatsServer
from tests.integration.segment_support import client, prepare, request, running_worker

ONE_WAY = 0.020
"""Seconds between the datacenters, each way."""

STEP = 400
"""IDs per segment: a fetch every 400 requests of one ID, so several fetches happen during the run."""

REQUESTS = 2000


def _through(dsn: str, port: int) -> str:
    """``dsn`` with its host and port replaced by the proxy's."""
    parts = urlsplit(dsn)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@127.0.0.1:{port}"))


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def _fetch_times(dsn: str, count: int) -> list[float]:
    async with await PostgresSegmentStore.connect(dsn) as store:
        await store.next_segment("probe")  # the pool's connection opened and the statement prepared
        times = []
        for _ in range(count):
            started = time.perf_counter()
            await store.next_segment("probe")
            times.append(time.perf_counter() - started)
    return times


@pytest.mark.asyncio
async def test_a_fetch_across_datacenters_costs_a_round_trip_and_requests_do_not_pay_it(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Fetches through 20 ms each way take ≥ 40 ms; requests answered meanwhile take a fraction of it."""
    await prepare(pg_dsn, [("probe", 10), ("order", STEP)])
    port = urlsplit(pg_dsn).port
    assert port is not None
    async with FaultProxy(("127.0.0.1", port)) as proxy:
        proxy.latency(ONE_WAY)
        across_dsn = _through(pg_dsn, proxy.address[1])
        within = await _fetch_times(pg_dsn, 20)
        across = await _fetch_times(across_dsn, 20)
        assert min(across) >= 2 * ONE_WAY, across  # the boundary is real: a round trip per fetch

        config = load_config(
            environ={
                "DISPENSER_NATS_URL": nats_server.url,
                "DISPENSER_POSTGRES_DSN": across_dsn,
                "DISPENSER_RATE_ADAPTIVE_STEP": "false",  # the tag's step, so that fetches come every 400 IDs
            }
        )
        async with running_worker(config) as worker, client(nats_server.url) as nc:
            latencies: list[float] = []
            during_fetch: list[float] = []
            body = b'{"count": 1}'
            for _ in range(REQUESTS):
                tag = worker.allocator.get("order")
                fetching = tag is not None and tag.buffer.fetching
                started = time.perf_counter()
                reply = msgspec.json.decode((await request(nc, "leaf.segment.order", body)).data, type=Reply)
                elapsed = time.perf_counter() - started
                assert reply.error is None, reply.error
                latencies.append(elapsed)
                if fetching:
                    during_fetch.append(elapsed)
            tag = worker.allocator.get("order")
            assert tag is not None
            fetches, fetch_seconds = tag.fetches, tag.fetch_seconds

    fetch_mean = fetch_seconds / fetches
    print(
        f"\nfetch within: p50 {statistics.median(within) * 1000:.1f} ms; across (20 ms each way): "
        f"p50 {statistics.median(across) * 1000:.1f} ms, max {max(across) * 1000:.1f} ms; "
        f"the worker's {fetches} fetches across: mean {fetch_mean * 1000:.1f} ms\n"
        f"{REQUESTS} requests from B's worker: p50 {_percentile(latencies, 50) * 1000:.2f} ms, "
        f"p90 {_percentile(latencies, 90) * 1000:.2f} ms, p99 {_percentile(latencies, 99) * 1000:.2f} ms, "
        f"max {max(latencies) * 1000:.1f} ms; {len(during_fetch)} sent while a fetch was in flight: "
        f"p50 {_percentile(during_fetch, 50) * 1000:.2f} ms, max {max(during_fetch) * 1000:.1f} ms; "
        f"over 40 ms: {sum(t >= 2 * ONE_WAY for t in latencies)}"
    )
    assert fetches >= REQUESTS // STEP - 1  # the worker did fetch across the boundary during the run
    assert fetch_mean >= 2 * ONE_WAY
    # Requests were answered while fetches were in flight, from the buffer: in a fraction of a fetch.
    assert len(during_fetch) >= fetches
    assert statistics.median(during_fetch) < ONE_WAY / 2, during_fetch
