"""A cluster named wrongly, and what `dispenser check` says of a right one.

A DSN that lists only standbys (or one standby alone) can never grant a segment: the worker starts anyway,
its answer is coded and retryable (a failover may make one of them primary), said once in its log, never a
traceback or a hang; `dispenser check` fails, naming the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.cli import main
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.patroni import PatroniCluster
from tests.integration.segment_support import ask, client, running_worker, worker_config

# Fixtures are what pytest passes; there is no call site to keep short.
# ruff: noqa: PLR0917

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha]


def standbys(cluster: PatroniCluster) -> list[str]:
    leader = cluster.leader()
    return [f"127.0.0.1:{n.port}" for n in cluster.nodes if n is not leader]


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("every-standby", "no primary among the DSN's 2 hosts"),
        ("one-standby", "connected to a standby, which cannot grant segments"),
    ],
)
async def test_a_dsn_without_the_primary_gets_one_clear_retryable_error(
    ha_cluster: PatroniCluster,
    ha_dsn: str,
    nats_server: NatsServer,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
    message: str,
) -> None:
    await migrate(ha_dsn)  # the standbys have the schema too: only the missing primary is wrong
    database = ha_dsn.rpartition("/")[2].partition("?")[0]
    await asyncio.to_thread(ha_cluster.wait_replayed)
    hosts = standbys(ha_cluster)
    if shape == "every-standby":
        dsn = f"postgresql://postgres@{','.join(hosts)}/{database}?target_session_attrs=read-write"
    else:
        dsn = f"postgresql://postgres@{hosts[0]}/{database}"
    config = worker_config(nats_server.url, dsn, fetch_deadline=1.0)

    # The worker starts all the same, says why in one line, and answers the coded retryable error.
    caplog.clear()
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        assert not worker.postgres.connected
        started = time.monotonic()
        reply = await ask(nc, "leaf.segment.order", b'{"count": 1}', timeout=10)
        assert time.monotonic() - started < 8
        assert reply.error is not None
        assert reply.error.code == "unavailable"
        assert reply.error.retryable
        assert message in reply.error.message
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    assert message in loud[0].getMessage()
    assert loud[0].exc_info is None

    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", dsn)
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    assert await asyncio.to_thread(main, ["check"]) == 1
    out = capsys.readouterr().out
    assert "FAIL postgres: segment store unavailable" in out
    assert message in out
    assert "Traceback" not in out


async def test_check_reports_the_primary_and_synchronous_replication(
    ha_cluster: PatroniCluster,
    ha_dsn: str,
    nats_server: NatsServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", ha_dsn)
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    assert await asyncio.to_thread(main, ["migrate"]) == 0
    leader = ha_cluster.leader()
    assert leader is not None
    assert await asyncio.to_thread(main, ["check"]) == 0
    out = capsys.readouterr().out
    assert f"primary 127.0.0.1:{leader.port}, replicating synchronously to 2 standby(s)" in out
    assert "WARN" not in out
