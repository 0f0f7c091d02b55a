"""The lab's ordered-tag benchmark, a tiny run (no timing asserted): it starts, measures both tags, checks."""

from __future__ import annotations

import asyncio

import pytest

from dispenser_lab.bench.ordered_bench import main
from dispenser_lab.servers import NatsServer

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


async def test_a_tiny_ordered_bench_run(
    nats_server: NatsServer, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two workers, one short window per tag: a row for each, and no ordered reply below one before it."""
    argv = ["--workers", "2", "--inflight", "4", "--duration", "0.3", "--rounds", "1"]
    argv += ["--nats-url", nats_server.url, "--postgres-dsn", pg_dsn]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "| bench-plain |" in out
    assert "| bench-ordered |" in out
    assert "ordered: 0 replies not above every ID received before them" in out
