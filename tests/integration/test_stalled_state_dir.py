"""Issue 29 item 10: a stalled state-dir disk (NFS, a frozen block device) costs fetches, not the process.

Before, every tag's fetch waited for ever on the one grant writer, stuck in the default executor, and the
process then outlived its 8 s stop budget (asyncio joins that executor's threads without a timeout). The
stalled disk is a writer that blocks (the adapter's seam, ``grants.write_atomically``): in this process for
the store, and in a ``dispenser serve`` child started through a small wrapper for the stop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import asyncpg
import pytest

import dispenser.adapters.local.grants as grants_module
from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.local.statefile import write_atomically
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable
from dispenser_lab.servers import NatsServer
from tests.integration.segment_support import (
    ask,
    client,
    prepare,
    spawned,
    stopped_by_sigterm,
    wait_answering,
    wait_until,
)

pytestmark = [pytest.mark.postgres]


async def max_id(dsn: str, tag: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        value: int = await conn.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = $1", tag)
        return value
    finally:
        await conn.close()


async def test_a_fetch_whose_grant_cannot_be_remembered_fails_unavailable_and_burns_no_more(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant made while the disk stalls is skipped (a gap); later fetches fail before granting; then it serves."""
    await migrate(pg_dsn)
    disk = threading.Event()
    real = write_atomically

    def stalled_disk(path: Path, payload: bytes) -> None:
        disk.wait()
        real(path, payload)

    grants = GrantFile.open(tmp_path / "state")
    grants.write_timeout = 0.2
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.add_tag("order", 100)
            assert (await store.next_segment("order")).segment.first == 1
            monkeypatch.setattr(grants_module, "write_atomically", stalled_disk)
            with pytest.raises(StoreUnavailable, match="could not be saved") as failed:
                await asyncio.wait_for(store.next_segment("order"), 10)  # before: for ever
            assert failed.value.retryable
            assert await max_id(pg_dsn, "order") == 201  # [101, 200] granted, not handed out: a gap
            with pytest.raises(StoreUnavailable, match="no segment is fetched until it does"):
                await store.next_segment("order")
            assert await max_id(pg_dsn, "order") == 201  # refused before granting: nothing burnt
            disk.set()
            await wait_until(lambda: grants.stalled() is None, what="the stalled write ends")
            assert (await store.next_segment("order")).segment.first == 201
    finally:
        disk.set()
        grants.close()


# `dispenser serve` whose grant writes block for ever once the file named by $STALL exists: the disk
# stalls while the worker serves.
_STALLING_SERVE = """
import os, sys, threading
from pathlib import Path
import dispenser.adapters.local.grants as grants
real = grants.write_atomically
def write(path, payload):
    if Path(os.environ["STALL"]).exists():
        threading.Event().wait()
    real(path, payload)
grants.write_atomically = write
from dispenser.cli import main
sys.exit(main(["serve"]))
"""


@pytest.mark.nats
async def test_serve_with_a_stalled_state_dir_answers_unavailable_and_stops_on_sigterm(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """A worker whose state directory stalls answers ``unavailable`` for the tag it cannot fetch and exits on SIGTERM.

    Before, the request waited its deadline, and after SIGTERM the process never exited (the stuck write's
    thread was joined at exit).
    """
    await prepare(pg_dsn, [("order", 5)])
    stall = tmp_path / "stall"
    log_path = tmp_path / "serve.log"
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": pg_dsn,
        "DISPENSER_LOG_LEVEL": "INFO",
        "DISPENSER_NATS_SUBJECT_PREFIX": "stall",
        "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.5",
        "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_RATE_ADAPTIVE_STEP": "false",  # segments of the tag's 5 IDs: 20 asked run past both buffers
        "STALL": str(stall),
    }
    async with spawned([sys.executable, "-c", _STALLING_SERVE], env, log_path) as proc:
        async with client(nats_server.url) as nc:
            await wait_answering(nc, "stall.segment.order", proc, log_path)
            stall.touch()  # the disk stalls
            reply = await ask(nc, "stall.segment.order", b'{"count": 20}', timeout=5)
            assert reply.error is not None, reply
            assert (reply.error.code, reply.error.retryable) == ("unavailable", True)
        status = await stopped_by_sigterm(proc)
    text = log_path.read_text()
    assert status == 0, text
    assert "stopped" in text, text
