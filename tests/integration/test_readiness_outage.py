"""A PostgreSQL outage that outlasts every buffer: the worker stays ready and answers the coded `unavailable`.

A shared database's outage reaches every worker at once; had each turned unready, a Service would have had no
endpoint left and Leaf's HTTP callers would have got the load balancer's refusal instead of a retryable error
(docs/operations.md, "Probes"; docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from dispenser.config import load_config
from dispenser.readiness import cannot_issue
from dispenser_lab.servers import NatsServer, PostgresServer

from .segment_support import prepare, running_worker, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

DRY = "segment: PostgreSQL cannot be reached and no segment IDs are buffered"


async def _get(session: aiohttp.ClientSession, path: str) -> tuple[int, str, str | None]:
    async with session.get(path) as response:
        return response.status, await response.text(), response.headers.get("Dispenser-Error-Code")


async def _ready(session: aiohttp.ClientSession) -> tuple[int, object]:
    status, body, _ = await _get(session, "/readyz")
    return status, json.loads(body)


async def test_a_worker_whose_buffers_ran_dry_in_an_outage_stays_ready_and_answers_unavailable(
    nats_server: NatsServer, private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """Buffers dry, PostgreSQL down: /readyz 200, Leaf's API answers `unavailable`; cannot_issue names it."""
    dsn = private_postgres.dsn
    await prepare(dsn, [("demo", 10)])
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_POSTGRES_COMMAND_TIMEOUT": "0.5",
        "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.3",
        "DISPENSER_SEGMENT_RETRY_MAX": "0.2",
        "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_HTTP_PORT": "0",
        "DISPENSER_RATE_ADAPTIVE_STEP": "false",  # segments of the tag's 10 IDs: dry after 20
    }
    async with (
        running_worker(load_config(environ=env)) as worker,
        aiohttp.ClientSession(worker.http.url) as session,
    ):
        assert (await _get(session, "/api/segment/get/demo"))[0] == 200
        assert (await _get(session, "/readyz?issue=1"))[0] == 200
        assert await _ready(session) == (200, {"status": "ready"})
        await asyncio.to_thread(private_postgres.stop)
        for _ in range(100):  # at most the two buffered segments' IDs, then the outage shows
            status, _, code = await _get(session, "/api/segment/get/demo")
            if status != 200:
                break
        assert code == "unavailable", (status, code)  # Leaf's form: 500 and Result{id=-3}, coded
        assert cannot_issue(worker.probed) == [DRY]
        assert await _ready(session) == (200, {"status": "ready", "cannot_issue": [DRY]}), (
            "ready: it answers, with a coded error; the body says what it cannot issue"
        )
        status, body, _ = await _get(session, "/readyz?issue=1")  # the stricter probe
        assert (status, json.loads(body)["cannot_issue"]) == (503, [DRY])
        await asyncio.to_thread(private_postgres.start)
        await wait_until(lambda: cannot_issue(worker.probed) == [], what="the tag fetching again", timeout=15)
        assert (await _get(session, "/api/segment/get/demo"))[0] == 200
        assert (await _get(session, "/readyz?issue=1"))[0] == 200
