"""PostgreSQL failover under load: kill -9 of the Patroni leader's whole process tree while NATS clients ask.

A real worker (in this process) serves real NATS requesters from a 3-node Patroni cluster in strict
synchronous mode, reached through one multi-host DSN with ``target_session_attrs=read-write``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import nats.errors
import pytest

from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.patroni import PatroniCluster
from tests.integration.segment_support import client, prepare, running_worker, worker_config

from .load_support import LoadResult, load, until

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha, pytest.mark.slow]


@dataclass
class Idempotent:
    """A requester of ``buffered`` that sends every request with a fresh ``request_id``."""

    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timeouts: int = 0
    ids: list[int] = field(default_factory=list)


async def ask_with_request_ids(url: str, seen: Idempotent, stop: asyncio.Event) -> None:
    async with client(url) as nc:
        for n in itertools.count():
            if stop.is_set():
                return
            body = f'{{"count": 10, "request_id": "failover-{n}"}}'.encode()
            started = time.monotonic()
            try:
                msg = await nc.request("leaf.segment.buffered", body, timeout=3.0)
            except nats.errors.TimeoutError:
                seen.timeouts += 1
                continue
            reply = msgspec.json.decode(msg.data, type=Reply)
            if reply.error is not None:
                seen.errors.append(reply.error.code)
                continue
            seen.latencies.append(time.monotonic() - started)
            seen.ids.extend(reply.ids or [])


def answered_after(result: LoadResult, moment: float) -> int:
    """Requests answered with IDs after ``moment`` (monotonic seconds)."""
    return sum(1 for per in result.successes for s in per if s.at > moment)


async def test_leader_killed_under_load(
    ha_cluster: PatroniCluster, ha_dsn: str, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No ID twice; a tag holding IDs never notices; an empty one answers coded `unavailable`, then recovers.

    ``buffered`` has segments far larger than what the load takes during a failover (as when segments are
    sized for S seconds of traffic); ``dry`` has 50-ID segments, used up within milliseconds, so it needs
    the store during the failover. The same worker serves throughout: nothing restarts it.
    """
    await prepare(ha_dsn, [("buffered", 5_000_000), ("dry", 50)])
    config = worker_config(nats_server.url, ha_dsn, fetch_deadline=1.0)
    # Segments of the configured size, so that `dry` does run dry (the adaptive step would grow them).
    config = msgspec.structs.replace(config, rate=msgspec.structs.replace(config.rate, adaptive_step=False))
    url = [nats_server.url]
    async with (
        running_worker(config) as worker,
        load([url, url], ["leaf.segment.buffered"], timeout=3.0) as buffered,
        load([url, url], ["leaf.segment.dry"], timeout=3.0) as dry,
    ):
        idempotent = Idempotent()
        stop = asyncio.Event()
        asking = asyncio.create_task(ask_with_request_ids(nats_server.url, idempotent, stop))
        await until(lambda: dry.answered() > 100 and buffered.answered() > 100, 30, "load running")
        await until(lambda: len(idempotent.latencies) > 20, 30, "request_id load running")
        caplog.clear()
        killed_at = time.monotonic()
        old = await asyncio.to_thread(ha_cluster.kill_leader)
        new = await asyncio.to_thread(ha_cluster.wait_leader, other_than=old)
        elected_at = time.monotonic()
        # Served again by the same worker: `dry` hands out IDs fetched after the new leader took over.
        await until(lambda: answered_after(dry, elected_at) > 100, 60, "dry served again")
        allocator = worker.allocator
        await until(lambda: allocator.tags["dry"].last_error is None, 30, "dry recovered")
        buffered_stall = buffered.stall(killed_at)
        stop.set()
        await asking

    assert dry.duplicates() == 0, "a dry-tag ID was handed out twice"
    assert buffered.duplicates() == 0, "a buffered-tag ID was handed out twice"
    assert not dry.malformed
    assert not buffered.malformed
    # The tag holding IDs noticed nothing: no error, no timeout, no request waited on the failover.
    assert not buffered.errors
    assert not buffered.timeouts
    assert buffered_stall < 1.0, buffered_stall
    # With a request_id, the fleet-wide replay store (PostgreSQL) is asked too: for no longer than the
    # request's deadline (1 s here). One whose answer cannot be recorded in it meanwhile is refused with the
    # retryable `unavailable` (limits.dedup_unsettled = "refuse", the default: never an answer a retry on
    # another worker would not get; tests/ha/test_request_id_failover.py), and none waits longer.
    assert set(idempotent.errors) <= {"unavailable"}, idempotent.errors
    assert not idempotent.timeouts
    assert max(idempotent.latencies) < 1.6, max(idempotent.latencies)  # 2.04 s before the bound
    assert len(idempotent.ids) == len(set(idempotent.ids))
    assert set(idempotent.ids).isdisjoint(buffered.ids)
    # The empty one got only the coded, retryable answer, within its deadline (no request timed out).
    assert set(dry.errors) <= {"unavailable"}, dry.errors
    assert not dry.not_retryable
    assert not dry.timeouts
    first = min(s.at for per in dry.successes for s in per if s.at > killed_at + 1.0)
    print(
        f"\nfailover {old.name} -> {new.name}: leader after {elected_at - killed_at:.1f} s, first dry-tag "
        f"reply from a new fetch {first - killed_at:.1f} s after the kill; {dry.errors['unavailable']} "
        f"unavailable; buffered stall {buffered_stall:.3f} s; request_id requests: longest "
        f"{max(idempotent.latencies):.2f} s; {len(dry.ids) + len(buffered.ids)} IDs"
    )
    # One line per tag and outage: no traceback, and at most one warning per tag for the fetch failures.
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in loud if r.exc_info], [r.getMessage() for r in loud if r.exc_info]
    fetch_warnings = [r for r in loud if "segment fetch for 'dry' failed" in r.getMessage()]
    assert len(fetch_warnings) == 1, [r.getMessage() for r in loud]
    assert "segment fetch for 'buffered'" not in " ".join(r.getMessage() for r in loud)
