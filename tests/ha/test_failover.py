"""PostgreSQL failover under load: kill -9 of the Patroni leader's whole process tree while NATS clients ask.

A real worker (in this process) serves real NATS requesters from a 3-node Patroni cluster in strict
synchronous mode, reached through one multi-host DSN with ``target_session_attrs=read-write``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest

from dispenser.testing.servers import NatsServer
from dispenser.testing.servers.patroni import PatroniCluster
from tests.integration.segment_support import prepare, running_worker, worker_config

from .load_support import LoadResult, load, until

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha, pytest.mark.slow]


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
        await until(lambda: dry.answered() > 100 and buffered.answered() > 100, 30, "load running")
        caplog.clear()
        killed_at = time.monotonic()
        old = await asyncio.to_thread(ha_cluster.kill_leader)
        new = await asyncio.to_thread(ha_cluster.wait_leader, other_than=old)
        elected_at = time.monotonic()
        # Served again by the same worker: `dry` hands out IDs fetched after the new leader took over.
        await until(lambda: answered_after(dry, elected_at) > 100, 60, "dry served again")
        allocator = worker.allocator
        assert allocator is not None
        await until(lambda: allocator.tags["dry"].last_error is None, 30, "dry recovered")
        buffered_stall = buffered.stall(killed_at)

    assert dry.duplicates() == 0, "a dry-tag ID was handed out twice"
    assert buffered.duplicates() == 0, "a buffered-tag ID was handed out twice"
    assert not dry.malformed
    assert not buffered.malformed
    # The tag holding IDs noticed nothing: no error, no timeout, no request waited on the failover.
    assert not buffered.errors
    assert not buffered.timeouts
    assert buffered_stall < 1.0, buffered_stall
    # The empty one got only the coded, retryable answer, within its deadline (no request timed out).
    assert set(dry.errors) <= {"unavailable"}, dry.errors
    assert not dry.not_retryable
    assert not dry.timeouts
    first = min(s.at for per in dry.successes for s in per if s.at > killed_at + 1.0)
    print(
        f"\nfailover {old.name} -> {new.name}: leader after {elected_at - killed_at:.1f} s, first dry-tag "
        f"reply from a new fetch {first - killed_at:.1f} s after the kill; {dry.errors['unavailable']} "
        f"unavailable; buffered stall {buffered_stall:.3f} s; {len(dry.ids) + len(buffered.ids)} IDs"
    )
    # One line per tag and outage: no traceback, and at most one warning per tag for the fetch failures.
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in loud if r.exc_info], [r.getMessage() for r in loud if r.exc_info]
    fetch_warnings = [r for r in loud if "segment fetch for 'dry' failed" in r.getMessage()]
    assert len(fetch_warnings) == 1, [r.getMessage() for r in loud]
    assert "'buffered'" not in " ".join(r.getMessage() for r in loud)
