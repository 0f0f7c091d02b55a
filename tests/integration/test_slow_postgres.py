"""Issue 22 item 7: a slow PostgreSQL (every query +500 ms, through the fault proxy) costs fetches, not requests.

A worker reaches PostgreSQL through a :class:`~dispenser_lab.faultproxy.FaultProxy` that delays every
chunk 250 ms each way, so each round trip (a query and its answer) takes 500 ms more. Requests for a tag
whose buffer holds IDs are answered from memory and do not pay it; a tag whose segment is one request
long makes every request wait for a fetch, which does pay it (and still ends well inside the fetch
deadline). No request fails.
"""

from __future__ import annotations

import statistics
import time
from urllib.parse import urlsplit, urlunsplit

import msgspec
import pytest

from dispenser_lab.faultproxy import FaultProxy
from dispenser_lab.servers import NatsServer
from tests.integration.segment_support import ask, client, ids_of, prepare, running_worker, worker_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

DELAY = 0.25
"""Seconds each way: 500 ms per query."""


def through(dsn: str, proxy: FaultProxy) -> str:
    """``dsn`` with its host and port replaced by the proxy's."""
    parts = urlsplit(dsn)
    credentials = parts.netloc.rpartition("@")[0]
    host, port = proxy.address
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def test_a_slow_postgres_costs_fetches_not_buffered_requests(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    await prepare(pg_dsn, [("buffered", 100_000), ("short", 10)])
    parts = urlsplit(pg_dsn)
    assert parts.hostname is not None
    assert parts.port is not None
    body = msgspec.json.encode({"count": 10})
    async with FaultProxy((parts.hostname, parts.port)) as proxy:
        config = worker_config(nats_server.url, through(pg_dsn, proxy))
        # Segments of the configured size, so that `short` stays one request long (the adaptive step would
        # grow it).
        config = msgspec.structs.replace(
            config, rate=msgspec.structs.replace(config.rate, adaptive_step=False)
        )
        async with running_worker(config), client(nats_server.url) as nc:
            # Both tags loaded (and their next segments fetched) while PostgreSQL is still fast.
            for tag in ("buffered", "short"):
                ids_of(await ask(nc, f"leaf.segment.{tag}", body))
            proxy.latency(DELAY)
            buffered: list[float] = []
            short: list[float] = []
            issued: list[tuple[str, int]] = []
            for _ in range(6):
                for tag, times in (("buffered", buffered), ("short", short)):
                    started = time.monotonic()
                    reply = await ask(nc, f"leaf.segment.{tag}", body, timeout=5.0)
                    times.append(time.monotonic() - started)
                    issued += [(tag, i) for i in ids_of(reply)]  # raises on an error reply
    print(
        f"\nPostgreSQL +{2 * DELAY * 1000:.0f} ms per query: buffered requests median "
        f"{statistics.median(buffered) * 1000:.1f} ms, max {max(buffered) * 1000:.1f} ms; requests that wait "
        f"for a fetch median {statistics.median(short) * 1000:.0f} ms, max {max(short) * 1000:.0f} ms"
    )
    assert len(issued) == len(set(issued))
    # Buffered: answered from memory, well under one delayed query.
    assert max(buffered) < DELAY, buffered
    # A segment of one request: from the second request on, each waits for a fetch over the slow link.
    assert min(short[1:]) >= 2 * DELAY * 0.9, short
    assert max(short) < 4.0, short
