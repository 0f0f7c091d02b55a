"""Leaf's HTTP API end to end: aiohttp's client against a real worker (real NATS, real PostgreSQL)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from dispenser.app import Worker
from dispenser.config import Config, load_config
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.process import free_port

from .segment_support import prepare, running_worker, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

LEAF_LAYOUT = SnowflakeLayout(timestamp_bits=41, worker_bits=10, sequence_bits=12, epoch_ms=1288834974657)


def http_config(nats_url: str, dsn: str, state_dir: Path, **extra: str) -> Config:
    """Segments and snowflake (static worker ID 7), Leaf's API on a free port, any other ``DISPENSER_*``."""
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_WORKER_ID": "7",
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(state_dir),
        "DISPENSER_SNOWFLAKE_PEER_CHECK_TIMEOUT": "0.1",
        "DISPENSER_HTTP_PORT": "0",
    }
    return load_config(environ=env | extra)


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[Worker, aiohttp.ClientSession]]:
    """A running worker and an HTTP client session aimed at its Leaf API."""
    async with running_worker(config) as worker, aiohttp.ClientSession(worker.http.url) as session:
        yield worker, session


async def get_text(session: aiohttp.ClientSession, path: str) -> tuple[int, str]:
    async with session.get(path) as response:
        return response.status, await response.text()


async def get_json(session: aiohttp.ClientSession, path: str) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with session.get(path) as response:
        return response.status, await response.json(content_type=None), response


async def test_leaf_paths_answer_ids_as_plain_text_over_one_kept_alive_connection(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """`/api/segment/get/demo` answers 1, 2, 3 (and 4 to a POST) as text; snowflake IDs are worker 7's; one connection."""
    await prepare(pg_dsn, [("demo", 1000)])
    created: list[object] = []
    trace = aiohttp.TraceConfig()

    async def on_create(*_args: object) -> None:
        created.append(object())

    trace.on_connection_create_end.append(on_create)
    async with (
        running_worker(http_config(nats_server.url, pg_dsn, tmp_path)) as worker,
        aiohttp.ClientSession(worker.http.url, trace_configs=[trace]) as session,
    ):
        answers = []
        for _ in range(3):
            async with session.get("/api/segment/get/demo") as response:
                assert response.status == 200
                assert response.content_type == "text/plain"
                answers.append(await response.text())
        assert answers == ["1", "2", "3"]
        async with session.post("/api/segment/get/demo") as response:  # any method, as Leaf's mapping
            assert (response.status, await response.text()) == (200, "4")
        snowflakes = [int((await get_text(session, "/api/snowflake/get/order"))[1]) for _ in range(50)]
    assert snowflakes == sorted(set(snowflakes))
    assert {LEAF_LAYOUT.decompose(i).worker_id for i in snowflakes} == {7}
    assert len(created) == 1  # keep-alive: 54 requests, one connection


async def test_decode_snowflake_id_answers_leafs_map(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """`/decodeSnowflakeId` answers Leaf's strings; a bad number Leaf's errorMsg; no number Spring's 400."""
    await prepare(pg_dsn, [])
    async with serving(http_config(nats_server.url, pg_dsn, tmp_path)) as (_worker, session):
        snowflake_id = int((await get_text(session, "/api/snowflake/get/order"))[1])
        status, body, _ = await get_json(session, f"/decodeSnowflakeId?snowflakeId={snowflake_id}")
        fields = LEAF_LAYOUT.decompose(snowflake_id)
        assert status == 200
        assert set(body) == {"timestamp", "workerId", "sequenceId"}
        assert body["workerId"] == "7"
        assert body["sequenceId"] == str(fields.sequence)
        millis = fields.timestamp_ms % 1000
        shown = fields.datetime.strftime("%Y-%m-%d %H:%M:%S")
        assert body["timestamp"] == f"{fields.timestamp_ms}({shown}.{millis:03d})"
        for bad in ("abc", "1.5", str(2**63), "-1", "%20 5"):
            status, body, _ = await get_json(session, f"/decodeSnowflakeId?snowflakeId={bad}")
            assert status == 200, bad
            assert body["errorMsg"] == "snowflake Id反解析发生异常!"
            assert body["code"] in {"bad_request", "invalid_id"}
        status, body, _ = await get_json(session, "/decodeSnowflakeId")
        assert status == 400
        assert body["exception"] == "org.springframework.web.bind.MissingServletRequestParameterException"
        assert body["message"] == "Required String parameter 'snowflakeId' is not present"
        status, body, _ = await get_json(session, "/api/nothing/here")
        assert (status, body["status"], body["error"], body["path"]) == (
            404,
            404,
            "Not Found",
            "/api/nothing/here",
        )


async def test_batch_form_answers_the_nats_reply_and_replays_request_ids(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """`?count=5` answers 5 IDs in JSON, `&format=ranges` ranges; a repeated request_id the same IDs."""
    await prepare(pg_dsn, [("demo", 100)])
    async with serving(http_config(nats_server.url, pg_dsn, tmp_path)) as (_worker, session):
        status, body, _ = await get_json(session, "/api/segment/get/demo?count=5")
        assert status == 200
        assert msgspec.convert(body, Reply) == Reply(tag="demo", ids=[1, 2, 3, 4, 5])
        status, body, _ = await get_json(session, "/api/segment/get/demo?count=250&format=ranges")
        ranges = msgspec.convert(body, Reply).ranges
        assert ranges is not None
        assert sum(last - first + 1 for first, last in ranges) == 250
        assert ranges[0][0] == 6
        first = await get_json(session, "/api/segment/get/demo?count=3&request_id=r-1")
        again = await get_json(session, "/api/segment/get/demo?count=3&request_id=r-1")
        assert first[1] == again[1]
        assert first[1]["request_id"] == "r-1"
        # The plain form takes a request_id too: a retry gets the same ID.
        assert (await get_text(session, "/api/segment/get/demo?request_id=p-1")) == (
            await get_text(session, "/api/segment/get/demo?request_id=p-1")
        )
        snowflake = await get_json(session, "/api/snowflake/get/order?count=1000&format=ranges")
        assert snowflake[0] == 200
        assert sum(b - a + 1 for a, b in snowflake[1]["ranges"]) == 1000


BATCH_ERRORS = [
    ("/api/segment/get/demo?count=0", 400, "invalid_count"),
    ("/api/segment/get/demo?count=abc", 400, "invalid"),
    ("/api/segment/get/demo?count=2&cuont=3", 400, "invalid"),
    ("/api/segment/get/demo?format=csv", 400, "invalid"),
    ("/api/segment/get/demo?count=10001", 413, "count_too_large"),
    ("/api/segment/get/demo?count=1000001&format=ranges", 413, "count_too_large"),
    ("/api/segment/get/nosuchtag?count=1", 404, "unknown_tag"),
    ("/api/segment/get/bad$tag?count=1", 400, "invalid_tag"),
    ("/api/snowflake/get/bad$tag?count=1", 400, "invalid_tag"),
    (f"/api/segment/get/demo?count=1&request_id={'r' * 129}", 400, "invalid"),
]

LEAF_ERRORS = [
    ("/api/segment/get/nosuchtag", -2, "unknown_tag"),
    ("/api/segment/get/bad$tag", -2, "invalid_tag"),
    ("/api/snowflake/get/bad$tag", -1, "invalid_tag"),
]


async def test_errors_have_leafs_status_and_body_or_the_nats_code(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Leaf's form: 500 and Spring's body with Leaf's Result; the batch form: the NATS error and its status."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with serving(http_config(nats_server.url, pg_dsn, tmp_path)) as (worker, session):
        for path, status, code in BATCH_ERRORS:
            got, body, response = await get_json(session, path)
            assert got == status, (path, body)
            reply = msgspec.convert(body, Reply)
            assert reply.error is not None
            assert reply.error.code == code, (path, reply.error)
            assert reply.error.retryable is False
            assert response.headers["Dispenser-Error-Code"] == code
        for path, result_id, code in LEAF_ERRORS:
            got, body, response = await get_json(session, path)
            assert got == 500, path
            assert body["status"] == 500
            assert body["error"] == "Internal Server Error"
            assert body["exception"] == "com.sankuai.inf.leaf.server.exception.LeafServerException"
            assert body["message"] == f"Result{{id={result_id}, status=EXCEPTION}}"
            assert body["path"] == path
            assert (body["code"], body["retryable"]) == (code, False)
            assert body["detail"]
            assert response.headers["Dispenser-Error-Code"] == code
        assert (await get_text(session, "/api/segment/get/demo")) == (200, "1")  # still serving
        # The errors are the dispatcher's: counted as NATS errors are.
        assert worker.dispatchers["segment"].errors["unknown_tag"] == 2


async def test_probes_and_metrics_beside_the_api_on_one_port(
    private_nats: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """With metrics.port = http.port: /metrics, /healthz, /readyz there; /readyz goes 503 while NATS is down."""
    await prepare(pg_dsn, [("demo", 1000)])
    port = str(free_port())
    config = http_config(
        private_nats.url, pg_dsn, tmp_path, DISPENSER_HTTP_PORT=port, DISPENSER_METRICS_PORT=port
    )
    async with serving(config) as (worker, session):
        assert worker.metrics is worker.http
        assert (await get_text(session, "/api/segment/get/demo")) == (200, "1")
        status, text = await get_text(session, "/metrics")
        assert status == 200
        assert 'leaf_ids_total{kind="segment",tag="demo"} 1.0' in text
        assert "leaf_build_info{version=" in text
        assert "process_cpu_seconds_total" in text
        assert "python_gc_objects_collected_total" in text
        assert await get_text(session, "/healthz") == (200, "ok\n")
        status, body, _ = await get_json(session, "/readyz")
        assert (status, body) == (200, {"status": "ready"})
        private_nats.stop()
        nc = worker.nc
        await wait_until(lambda: not nc.is_connected, what="the worker sees NATS gone")
        status, body, _ = await get_json(session, "/readyz")
        assert status == 503
        assert body["reasons"] == ["NATS is not connected"]
        assert await get_text(session, "/healthz") == (200, "ok\n")
        assert (await get_text(session, "/api/segment/get/demo")) == (200, "2")  # HTTP serves on
        private_nats.start()
        await wait_until(lambda: nc.is_connected, what="the worker reconnects to NATS")
        assert (await get_json(session, "/readyz"))[0] == 200
