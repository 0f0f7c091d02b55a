"""The status page in a real browser (Debian's headless Chromium) against real workers (NATS, PostgreSQL).

What the page shows is checked against the worker's own objects, and its live refresh against IDs taken
while it is open. ``DISPENSER_STATUS_SCREENSHOT=docs/status-page.png`` also saves the screenshot there
(the one in the docs is made so).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from dispenser.app import Off, Worker
from dispenser.config import Config, load_config
from dispenser.status import WorkerStatus
from dispenser_lab.servers import NatsServer

from .browser_support import headless_page
from .segment_support import prepare, running_worker, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

TAG = "order"

SHOWN = """(() => {
  const row = document.querySelector('tr[data-kind="segment"][data-tag="order"]');
  const cell = (field) => row.querySelector(`[data-field="${field}"]`);
  const flake = (field) => document.querySelector(`#snowflake [data-field="${field}"]`);
  return {
    step: cell("step").dataset.value,
    configured_step: cell("configured_step").dataset.value,
    ids_buffered: cell("ids_buffered").dataset.value,
    next_id: cell("current").dataset.value,
    ids_total: cell("ids_total").dataset.value,
    why: cell("why").dataset.value,
    peers: cell("peers").textContent,
    worker_id: flake("worker_id").dataset.value,
    holds_lease: flake("holds_lease").dataset.value,
    clock_offset_ms: flake("clock_offset_ms").dataset.value,
    invoice: document.querySelector('tr[data-kind="snowflake"][data-tag="invoice"] [data-field="ids_total"]')
      .dataset.value,
    ready: document.getElementById("ready").dataset.value,
    refresh: document.getElementById("refresh").textContent,
  };
})()"""


def status_config(
    nats_url: str, dsn: str, state_dir: Path, *, worker_id: int, datacenter: str, prefix: str
) -> Config:
    """Segments and snowflake, Leaf's API and the metrics port (with /status) each on a free port."""
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": prefix,  # this test's workers hear only each other
        "DISPENSER_NATS_DATACENTER": datacenter,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_WORKER_ID": str(worker_id),
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(state_dir),
        "DISPENSER_SNOWFLAKE_PEER_CHECK_TIMEOUT": "0.2",
        "DISPENSER_RATE_INTERVAL": "0.2",  # the peer's rate events, heard within the test
        "DISPENSER_HTTP_PORT": "0",
        "DISPENSER_METRICS_PORT": "0",
    }
    return load_config(environ=env)


async def take(session: aiohttp.ClientSession, path: str, times: int) -> None:
    for _ in range(times):
        async with session.get(path) as answer:
            assert answer.status == 200, await answer.text()


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's header."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def assert_shows_the_state(shown: dict[str, Any], worker: Worker, peer: Worker) -> None:
    """The page's values are the worker's: its tag's step and buffers, its peer, its snowflake ID and clock."""
    tag = worker.allocator.tags[TAG]
    stats = tag.stats()
    assert stats.current is not None
    assert shown["step"] == str(tag.last_step)
    assert shown["configured_step"] == "1000"
    assert shown["ids_buffered"] == str(tag.buffer.remaining)
    assert shown["next_id"] == str(stats.current.position)
    assert shown["ids_total"] == str(tag.meter.ids_issued) == "25"
    assert shown["why"] in ("floor", "cap", "kept", "sized")  # the rate moves: read at one moment
    assert peer.rates.worker in shown["peers"]
    assert "eu-central" in shown["peers"]
    assert shown["worker_id"] == str(worker.snowflake.worker_id) == "7"
    assert shown["holds_lease"] == "true"
    snowflake = worker.parts.snowflake
    assert not isinstance(snowflake, Off)
    offset = snowflake.clock_check.offset_ms
    assert offset is not None  # one peer answered the clock check
    assert shown["clock_offset_ms"] == str(round(offset, 1))
    assert shown["invoice"] == "3"
    assert shown["ready"] == "true"


async def test_the_page_shows_the_workers_state_in_a_browser_and_follows_it_live(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Step, buffer, next ID, peers, snowflake worker ID as the worker holds them; taking IDs changes the open page."""
    await prepare(pg_dsn, [(TAG, 1000)])
    prefix = f"status{secrets.token_hex(3)}"
    config = status_config(
        nats_server.url, pg_dsn, tmp_path / "a", worker_id=7, datacenter="eu-west", prefix=prefix
    )
    peer_config = status_config(
        nats_server.url, pg_dsn, tmp_path / "b", worker_id=8, datacenter="eu-central", prefix=prefix
    )
    async with (
        running_worker(peer_config) as peer,
        running_worker(config) as worker,  # second: its clock is checked against the peer's
        aiohttp.ClientSession(worker.http.url) as api,
        aiohttp.ClientSession(peer.http.url) as other,
    ):
        await take(api, f"/api/segment/get/{TAG}", 25)
        await take(api, "/api/snowflake/get/invoice", 3)
        await take(other, f"/api/segment/get/{TAG}", 5)
        tag = worker.allocator.tags[TAG]
        await wait_until(lambda: not tag.stats().fetching and bool(tag.stats().next), what="next segment in")
        await wait_until(
            lambda: any(e.worker == peer.rates.worker for e in worker.rates.peers("segment", TAG)),
            what="the peer's rate event heard",
        )
        async with headless_page(tmp_path / "chromium") as page:
            await page.navigate(f"{worker.metrics.url}/status")
            assert_shows_the_state(await page.evaluate(SHOWN), worker, peer)
            # Live: the open page (not reloaded) follows IDs taken now.
            await page.evaluate("window.notReloaded = true")
            await take(api, f"/api/segment/get/{TAG}", 40)
            expected = str(tag.meter.ids_issued)
            assert expected == "65"
            row = 'document.querySelector(\'tr[data-tag="order"] [data-field="ids_total"]\').dataset.value'
            await page.wait_for(
                f"{row} === '{expected}'", what="the page shows the IDs taken since it loaded"
            )
            assert await page.evaluate("window.notReloaded") is True
            refreshed = await page.evaluate(SHOWN)
            current = tag.stats().current
            assert current is not None
            assert refreshed["next_id"] == str(current.position)
            assert refreshed["ids_buffered"] == str(tag.buffer.remaining)
            assert refreshed["refresh"] == "live: refreshed every second"
            png = await page.screenshot()
    width, height = png_size(png)
    assert width == 1600
    assert height > 400
    target = os.environ.get("DISPENSER_STATUS_SCREENSHOT")
    if target:
        await asyncio.to_thread(Path(target).write_bytes, png)


async def test_the_page_is_served_only_where_the_metrics_are_and_can_be_turned_off(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """/status on the metrics port (with its CSP, no-store), not on the API's port; metrics.status_page = false: none."""
    await prepare(pg_dsn, [(TAG, 1000)])
    prefix = f"status{secrets.token_hex(3)}"
    config = status_config(nats_server.url, pg_dsn, tmp_path / "a", worker_id=7, datacenter="", prefix=prefix)
    async with running_worker(config) as worker, aiohttp.ClientSession() as session:
        async with session.get(f"{worker.http.url}/api/segment/get/{TAG}") as answer:
            assert answer.status == 200
        async with session.get(f"{worker.http.url}/status") as answer:
            assert answer.status == 404  # the API's callers never see every tag and its volume
        logging.getLogger("dispenser.test").warning("a warning for the page: <%s>", "mind the markup")
        async with session.get(f"{worker.metrics.url}/status") as answer:
            assert answer.status == 200
            assert answer.content_type == "text/html"
            assert answer.headers["Cache-Control"] == "no-store"
            assert answer.headers["Content-Security-Policy"].startswith("default-src 'none'")
            assert "&lt;mind the markup&gt;" in await answer.text()
        async with session.get(f"{worker.metrics.url}/status.json") as answer:
            assert answer.status == 200
            status = msgspec.json.decode(await answer.read(), type=WorkerStatus)
        assert [(t.tag, t.ids_total) for t in status.segments] == [(TAG, 1)]
        assert status.snowflake is not None
        assert status.snowflake.worker_id == 7
        assert status.recent_errors[0].message == "a warning for the page: <mind the markup>"
    off = msgspec.structs.replace(config, metrics=msgspec.structs.replace(config.metrics, status_page=False))
    async with running_worker(off) as worker, aiohttp.ClientSession() as session:
        async with session.get(f"{worker.metrics.url}/status") as answer:
            assert answer.status == 404
        async with session.get(f"{worker.metrics.url}/metrics") as answer:
            assert answer.status == 200
