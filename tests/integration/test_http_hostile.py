"""One HTTP caller cannot hurt another: hostile input against a real worker, with raw sockets and aiohttp.

Each test here failed on the worker before the guard (dispenser/adapters/http/guard.py) and the access
checks (dispenser/adapters/http/access.py): see the docstrings for what it did then.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import resource
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from dispenser.app import Worker
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.process import free_port

from .segment_support import prepare, running_worker
from .test_http import http_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


async def exchange(port: int, data: bytes, *, read_for: float = 5.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (or ``read_for`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(read_for):
                return await reader.read(-1)
        return b"<still open>"
    finally:
        writer.close()


def head_and_body(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """The status, the headers (lower-case names) and the body of the first answer in ``answer``."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", len(body)))
    return int(lines[0].split()[1]), headers, body[:length]


@contextlib.asynccontextmanager
async def api(nats_url: str, dsn: str, tmp_path: Path, **extra: str) -> AsyncIterator[Worker]:
    """A worker with Leaf's API (and the tag ``demo``) and any other ``DISPENSER_*`` setting."""
    await prepare(dsn, [("demo", 1000), ("other", 1000)])
    async with running_worker(http_config(nats_url, dsn, tmp_path, **extra)) as worker:
        yield worker


async def test_parse_errors_answer_coded_json_and_log_one_info_line(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request aiohttp cannot parse: 400 JSON with Dispenser-Error-Code, no ERROR and no traceback logged.

    Before: text/plain without the code header, and 9-12 lines at ERROR with a traceback per bad request.
    """
    caplog.set_level(logging.INFO)
    async with api(nats_server.url, pg_dsn, tmp_path) as worker:
        port = worker.http.port
        bad = [
            b"GET /api/segment/get/demo HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
            b"GET /api/segment/get/demo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        ]
        for _ in range(10):
            for data in bad:
                status, headers, body = head_and_body(await exchange(port, data))
                assert status in {400, 413, 414, 431}, body
                assert headers["content-type"].startswith("application/json")
                error = json.loads(body)["error"]
                assert headers["dispenser-error-code"] == error["code"]
                assert error["code"] in {"malformed", "too_large"}
                assert error["retryable"] is False
                assert "aiohttp" not in headers.get("server", "")
        async with (
            aiohttp.ClientSession(worker.http.url) as session,
            session.get("/api/segment/get/demo") as answer,
        ):
            assert answer.status == 200  # still serving
    ours = [r for r in caplog.records if r.name.startswith(("aiohttp", "dispenser.adapters.http"))]
    assert not [r for r in ours if r.levelno >= logging.WARNING]
    assert not [r for r in ours if r.exc_info]
    lines = [r for r in ours if "bad HTTP request" in r.getMessage()]
    assert 1 <= len(lines) < 30  # one a second at most, with the count of those left out


async def test_good_pipelined_requests_before_a_bad_one_are_answered(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Two good requests and a bad one in one write: 200, 200, then the 400, in order.

    Before: the parser's error dropped the requests it had parsed in the same chunk: only the 400 came back.
    """
    good = b"GET /api/segment/get/demo HTTP/1.1\r\nHost: x\r\n\r\n"
    async with api(nats_server.url, pg_dsn, tmp_path) as worker:
        answer = await exchange(worker.http.port, good + good + b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    statuses = [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]
    assert statuses == [200, 200, 400]
    assert answer.count(b"\r\n\r\n1") == 1
    assert answer.count(b"\r\n\r\n2") == 1


async def test_idle_and_slow_heads_are_cut_off(nats_server: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    """A connection that sends nothing, or its head byte by byte, is closed (keep-alive / head timeout).

    Before: aiohttp's 3,630 s applied to both: none of 5,000 idle or 500 slowloris connections was closed.
    """
    extra = {"DISPENSER_HTTP_KEEPALIVE_TIMEOUT": "1", "DISPENSER_HTTP_HEAD_TIMEOUT": "0.5"}
    async with api(nats_server.url, pg_dsn, tmp_path, **extra) as worker:
        port = worker.http.port
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)

        async def trickle() -> None:
            slow_writer.write(b"GET /api/segment/get/demo HTTP/1.1\r\nHost: x\r\n")
            for _ in range(100):  # one byte every 0.05 s: the head would take 5 s
                if slow_writer.is_closing():
                    return
                slow_writer.write(b"X")
                with contextlib.suppress(ConnectionError):
                    await slow_writer.drain()
                await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        try:
            async with asyncio.timeout(4.0):  # closed at 0.5 s (head) and 1 s (idle) of server time
                assert await slow_reader.read(-1) == b""
                assert await idle_reader.read(-1) == b""
        finally:
            trickling.cancel()
            idle_writer.close()
            slow_writer.close()
        # A caller that keeps to the timeouts is served on one connection, request after request.
        async with aiohttp.ClientSession(worker.http.url) as session:
            for _ in range(3):
                async with session.get("/api/segment/get/demo") as answer:
                    assert answer.status == 200


async def test_a_compressed_body_is_never_inflated(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """A deflate bomb in a body the ID route never reads: answered, the connection closed, no CPU spent on it.

    Before: the body was inflated while aiohttp drained it after the answer (1 GiB of zeros: ~2 s of the
    event loop's CPU, holding every other request of the worker).
    """
    block = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = block.compress(b"\0" * (1 << 20)) + block.flush(zlib.Z_FULL_FLUSH)
    bomb = piece * 1024 + zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # 1 GiB of zeros inflated
    async with api(nats_server.url, pg_dsn, tmp_path) as worker:
        head = (
            "POST /api/segment/get/demo HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\nConnection: close\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(bomb)}\r\n\r\n"
        ).encode()
        before = resource.getrusage(resource.RUSAGE_SELF)
        answer = await exchange(worker.http.port, head + bomb)
        after = resource.getrusage(resource.RUSAGE_SELF)
        status, _headers, body = head_and_body(answer)
        assert (status, body) == (200, b"1")
        # The worker runs in this process: the whole exchange cost it far less than inflating 1 GiB (~2 s).
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert cpu < 0.5, f"{cpu:.2f} s of CPU"


async def test_queries_are_as_strict_as_a_nats_body(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """`count=1e3`, `1.0`, `0.5e1`, `+5` and a parameter given twice are refused (400 invalid), as over NATS.

    Before: the floats were taken as counts, and `count=1&count=100000` kept the first (a proxy reading the
    last saw another request).
    """
    async with (
        api(nats_server.url, pg_dsn, tmp_path) as worker,
        aiohttp.ClientSession(worker.http.url) as session,
    ):
        for query in ("count=1e3", "count=1.0", "count=0.5e1", "count=%2B5", "count=1&count=100000"):
            async with session.get(f"/api/segment/get/demo?{query}") as answer:
                body = await answer.json()
                assert answer.status == 400, query
                assert body["error"]["code"] == "invalid", query
                assert answer.headers["Dispenser-Error-Code"] == "invalid"
        async with session.get("/api/segment/get/demo?request_id=a&request_id=b") as answer:
            assert answer.status == 500  # Leaf's form: Leaf's error body, with our code
            assert (await answer.json())["code"] == "invalid"
        async with session.get("/api/segment/get/demo?count=2") as answer:
            assert (await answer.json())["ids"] == [1, 2]


async def test_what_a_caller_sees_of_the_worker(nats_server: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    """No /metrics on the API port (unless it is the metrics port), no library version, a long decode answered.

    Before: /metrics (every tag and its volume) on the API port, `Server: Python/3.x aiohttp/3.x`, and
    `/decodeSnowflakeId` with 4,301 digits an uncoded 500 with a traceback.
    """
    async with (
        api(nats_server.url, pg_dsn, tmp_path) as worker,
        aiohttp.ClientSession(worker.http.url) as session,
    ):
        async with session.get("/metrics") as answer:
            assert answer.status == 404
        for path in ("/api/segment/get/demo", "/healthz", "/nothing"):
            async with session.get(path) as answer:
                assert answer.headers["Server"] == "leaf-dispenser", path
        for digits in ("9" * 5000, "0" * 5000 + "5"):
            async with session.get(f"/decodeSnowflakeId?snowflakeId={digits}") as answer:
                assert answer.status == 200
                body = await answer.json()
                if digits.endswith("5"):  # leading zeros, as Java's Long.parseLong reads them
                    assert body["sequenceId"] == "5"
                else:
                    assert body["errorMsg"] == "snowflake Id反解析发生异常!"
        for data in (
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ):
            status, headers, body = head_and_body(await exchange(worker.http.port, data, read_for=1.0))
            assert status >= 400, data
            assert headers["content-type"].startswith("application/json"), data
            assert "dispenser-error-code" in headers, data


async def test_connections_past_the_cap_are_refused_and_the_probes_answer_on(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """`dispenser serve` under a 300 file limit: the API's cap fits under it, the rest get 503, /healthz answers.

    Before: no cap and the soft limit left as it was: 1,100 idle sockets took the API, /healthz on the
    metrics port and the grant file ("Too many open files") with them, logging nothing.
    """
    await prepare(pg_dsn, [("demo", 1000)])
    http_port, metrics_port = free_port(), free_port()
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": pg_dsn,
        "DISPENSER_SNOWFLAKE_ENABLED": "false",
        "DISPENSER_HTTP_PORT": str(http_port),
        "DISPENSER_METRICS_PORT": str(metrics_port),
        "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path),
        "DISPENSER_LOG_LEVEL": "INFO",
    }
    log_path = tmp_path / "worker.log"
    proc = serve_with_file_limit(300, env, log_path)
    held: list[asyncio.StreamWriter] = []
    try:
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{metrics_port}/healthz") as answer:
                        return answer.status == 200
                return False

            for _ in range(100):
                if await healthy() and "serving Leaf's HTTP API" in log_path.read_text():
                    break
                assert proc.poll() is None, log_path.read_text()
                await asyncio.sleep(0.1)
            readers = []
            for _ in range(120):  # past the cap (300 - 256 kept for the rest = 44)
                reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
                readers.append(reader)
                held.append(writer)

            async def refusal(reader: asyncio.StreamReader) -> bool:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        answer = await reader.read(-1)
                        status, headers, body = head_and_body(answer)
                        assert (status, headers["dispenser-error-code"]) == (503, "too_many_connections")
                        assert json.loads(body)["error"]["retryable"] is True
                        return True
                return False

            refused = sum(await asyncio.gather(*(refusal(reader) for reader in readers)))
            assert refused == 120 - 44
            assert await healthy()  # the probes' port has its own sockets
            for writer in held:
                writer.close()
            held.clear()

            async def served() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{http_port}/api/segment/get/demo") as answer:
                        return answer.status == 200
                return False

            await wait_until_async(served, what="the API serves again once the idle sockets are gone")
        text = log_path.read_text()
        assert "http.max_connections lowered from 4096 to 44" in text
        assert "Too many open files" not in text
    finally:
        for writer in held:
            writer.close()
        proc.terminate()
        proc.wait(15)


def serve_with_file_limit(limit: int, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``dispenser serve`` under ``prlimit --nofile=limit:limit``, its output in ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            ["prlimit", f"--nofile={limit}:{limit}", sys.executable, "-m", "dispenser", "serve"],
            env=os.environ | env,
            stdout=log,
            stderr=log,
        )


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 5.0
) -> None:
    """Wait until the coroutine function ``condition`` returns true (an AssertionError naming ``what`` if not)."""
    try:
        async with asyncio.timeout(timeout):
            while not await condition():  # noqa: ASYNC110 - polls a server, no event to wait on
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


def token_file(tmp_path: Path, name: str, token: str) -> str:
    path = tmp_path / f"{name}.token"
    path.write_text(token + "\n")
    return str(path)


async def test_callers_need_a_token_and_stay_within_their_tags_and_budget(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """With `[[http.callers]]`: no token 401, another tag 403, over the budget 429 with Retry-After.

    Before: any caller who reached the port could take any tag's IDs, any number of them
    (`?count=1000000&format=ranges` from 16 connections: 1.88e11 IDs in 10 s).
    """
    orders = "orders-" + "o" * 20
    other = "other-" + "x" * 20
    config = tmp_path / "dispenser.toml"
    config.write_text(
        "[http]\nids_per_second = 1000\nids_burst = 5000\n"
        f'[[http.callers]]\nname = "orders"\ntoken_file = "{token_file(tmp_path, "orders", orders)}"\n'
        'tags = ["demo"]\nkinds = ["segment"]\n'
        f'[[http.callers]]\nname = "ops"\ntoken_sha256 = "{hashlib.sha256(other.encode()).hexdigest()}"\n'
    )
    async with (
        api(nats_server.url, pg_dsn, tmp_path, DISPENSER_CONFIG=str(config)) as worker,
        aiohttp.ClientSession(worker.http.url) as session,
    ):

        async def get(path: str, token: str | None) -> tuple[int, aiohttp.ClientResponse, bytes]:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            async with session.get(path, headers=headers) as answer:
                return answer.status, answer, await answer.read()

        status, answer, body = await get("/api/segment/get/demo", None)
        assert (status, answer.headers["Dispenser-Error-Code"]) == (401, "unauthorized")
        assert answer.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(body)["error"]["retryable"] is False
        assert (await get("/api/segment/get/demo", "wrong-token-wrong-token"))[0] == 401
        assert (await get("/api/segment/get/demo", orders))[::2] == (200, b"1")
        status, answer, _ = await get("/api/segment/get/other", orders)
        assert (status, answer.headers["Dispenser-Error-Code"]) == (403, "forbidden")
        assert (await get("/api/snowflake/get/demo", orders))[0] == 403  # segment only
        assert (await get("/api/snowflake/get/demo", other))[0] == 200  # ops: every tag and kind
        # The budget: 5,000 at once, then 1,000 a second.
        assert (await get("/api/segment/get/demo?count=5000&format=ranges", orders))[0] == 200
        status, answer, body = await get("/api/segment/get/demo?count=4000&format=ranges", orders)
        assert (status, answer.headers["Dispenser-Error-Code"]) == (429, "over_budget")
        assert 1 <= int(answer.headers["Retry-After"]) <= 4
        assert json.loads(body)["error"]["retryable"] is True
        status, _, body = await get("/api/segment/get/demo?count=6000&format=ranges", orders)
        assert status == 429
        assert json.loads(body)["error"]["retryable"] is False  # over the burst: never granted
        # Another caller's budget is its own.
        assert (await get("/api/segment/get/other?count=5000&format=ranges", other))[0] == 200


async def test_an_open_api_budgets_each_address(nats_server: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    """Without callers, each address has the default budget: a burst past it is refused, a retry later served."""
    extra = {"DISPENSER_HTTP_IDS_PER_SECOND": "100", "DISPENSER_HTTP_IDS_BURST": "1000000"}
    async with (
        api(nats_server.url, pg_dsn, tmp_path, **extra) as worker,
        aiohttp.ClientSession(worker.http.url) as session,
    ):
        path = "/api/segment/get/demo?count=1000000&format=ranges"
        async with session.get(path) as answer:
            assert answer.status == 200
        async with session.get(path) as answer:
            assert answer.status == 429
            assert answer.headers["Dispenser-Error-Code"] == "over_budget"
        async with session.get("/api/segment/get/demo?count=1000") as answer:
            assert answer.status == 429  # 10 s of refill away
        await asyncio.sleep(0.2)  # the budget refills at 100 a second
        async with session.get("/api/segment/get/demo?count=10") as answer:
            assert answer.status == 200
        async with session.get("/api/segment/get/demo") as answer:
            assert answer.status == 200  # one ID, no query: not counted
