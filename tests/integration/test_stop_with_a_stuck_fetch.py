"""Issue 29 item 12: a stop with a fetch abandoned on a silent database leaves no error behind.

Before, ``dispenser serve`` stopped by SIGTERM while a segment fetch hung on a blackholed PostgreSQL logged
``ERROR Task exception was never retrieved … PoolConnectionHolder.release()`` with a traceback at exit,
which log-based alerting counts as an error.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from pathlib import Path

import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser_lab.faultproxy import FaultProxy
from dispenser_lab.servers import NatsServer, PostgresServer
from tests.integration.segment_support import (
    ask,
    client,
    prepare,
    spawned,
    stopped_by_sigterm,
    wait_answering,
    wait_until,
)

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


async def test_sigterm_with_a_fetch_stuck_on_a_silent_database_logs_no_error(
    nats_server: NatsServer, postgres_server: PostgresServer, pg_dsn: str, tmp_path: Path
) -> None:
    """SIGTERM while a fetch hangs on a blackholed PostgreSQL: exit 0 within 10 s, no ERROR line, no traceback."""
    await prepare(pg_dsn, [("order", 5)])
    database = pg_dsn.rpartition("/")[2]
    log_path = tmp_path / "serve.log"
    async with FaultProxy(("127.0.0.1", postgres_server.port)) as proxy:
        env = {
            "DISPENSER_NATS_URL": nats_server.url,
            "DISPENSER_POSTGRES_DSN": f"postgresql://postgres@{proxy.address[0]}:{proxy.address[1]}/{database}",
            "DISPENSER_LOG_LEVEL": "INFO",
            "DISPENSER_NATS_SUBJECT_PREFIX": "stuck",
            # Longer than the stop's budget: before, the stop waited for the stuck statement's cancellation
            # (up to command_timeout + connect_timeout) and exited after 30 s, past its 8 s budget.
            "DISPENSER_POSTGRES_COMMAND_TIMEOUT": "30",
            "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.5",
            "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state"),
            "DISPENSER_RATE_ADAPTIVE_STEP": "false",  # segments of the tag's 5 IDs: 20 asked run past both buffers
        }
        async with spawned([sys.executable, "-m", "dispenser", "serve"], env, log_path) as proc:
            async with client(nats_server.url) as nc:
                await wait_answering(nc, "stuck.segment.order", proc, log_path)
                proxy.blackhole()
                # Drain the buffers: the fetch that follows hangs on the silent database.
                reply = await ask(nc, "stuck.segment.order", b'{"count": 20}', timeout=5)
                assert reply.error is not None, reply
                assert reply.error.code == "unavailable", reply
            status = await stopped_by_sigterm(proc)
    text = log_path.read_text()
    assert status == 0, text
    assert "never retrieved" not in text, text
    assert "Traceback" not in text, text
    assert [line for line in text.splitlines() if " ERROR " in line] == [], text


def releases() -> set[asyncio.Task[object]]:
    """The shielded releases of a pooled connection now running (``PoolConnectionHolder.release``)."""
    return {t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "PoolConnectionHolder.release"}  # type: ignore[union-attr]


async def test_a_fetch_cancelled_while_its_connection_is_released_leaves_no_unretrieved_error(
    postgres_server: PostgresServer, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop that cancels a fetch while its timed-out connection is being released: no "never retrieved".

    The statement times out on the silent database, the connection's release waits (shielded) for the server
    to confirm the cancellation, and the stop cancels the fetch right then: the release's error came later,
    with nobody left to retrieve it, and asyncio logged it at ERROR when the task was collected.
    """
    await prepare(pg_dsn, [("order", 5)])
    database = pg_dsn.rpartition("/")[2]
    async with FaultProxy(("127.0.0.1", postgres_server.port)) as proxy:
        dsn = f"postgresql://postgres@{proxy.address[0]}:{proxy.address[1]}/{database}"
        async with await PostgresSegmentStore.connect(dsn, command_timeout=0.3) as store:
            await store.next_segment("order")
            proxy.blackhole()
            fetch = asyncio.create_task(store.next_segment("order"))
            await wait_until(
                lambda: bool(releases()) or fetch.done(), what="the timed-out connection is released"
            )
            released = releases()
            fetch.cancel()  # the stop
            await asyncio.gather(fetch, return_exceptions=True)
            await wait_until(lambda: all(t.done() for t in released), what="the releases end")
            released.clear()  # the tasks go: asyncio logs an unretrieved error when one is collected
        gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
