"""``dispenser serve --processes 2`` against real servers (issue 32 item 1).

One supervisor, two worker processes: both answer on the one HTTP port (``SO_REUSEPORT``), in the NATS
queue group and in the Kafka consumer group, each under a snowflake worker ID of its own from the PostgreSQL registry, every ID unique
across them; the host's one ``/metrics`` shows each process's counters; a process killed with SIGKILL is
restarted (and logged); SIGTERM stops them all within the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from dispenser.app.supervisor import supervise
from dispenser.client import KafkaIdClient
from dispenser.config import load_config
from dispenser.registries import layout_of
from dispenser_lab.servers import NatsServer, free_port
from dispenser_lab.servers.kafka import KafkaBroker
from dispenser_lab.servers.process import sigstop
from tests.integration.kafka_support import create_topics, kafka_env, serving_topics
from tests.integration.segment_support import (
    ask,
    client,
    ids_of,
    prepare,
    spawned,
    stopped_by_sigterm,
    wait_serving,
    wait_until,
)

pytestmark = [pytest.mark.postgres]

_TAG = "order"
_SERVE = [sys.executable, "-m", "dispenser", "serve", "--processes", "2"]


def _env(nats_url: str, dsn: str, tmp_path: Path, http_port: int, metrics_port: int) -> dict[str, str]:
    return {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": "procs",
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_LOG_LEVEL": "INFO",
        "DISPENSER_HTTP_PORT": str(http_port),
        "DISPENSER_METRICS_PORT": str(metrics_port),
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_MODE": "postgres",  # the registry hands each process a worker ID of its own
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_SNOWFLAKE_PEER_CHECK_TIMEOUT": "0.05",
        "DISPENSER_SEGMENT_RESIDUE_CHECK_WINDOW": "0.05",
        # A restarted process waits out the mark reserved one report ahead: short, for the kill's restart.
        "DISPENSER_SNOWFLAKE_REPORT_INTERVAL": "0.3",
    }


async def _readyz(session: aiohttp.ClientSession, metrics_port: int) -> tuple[int, dict[str, object]]:
    try:
        async with session.get(f"http://127.0.0.1:{metrics_port}/readyz") as response:
            return response.status, await response.json()
    except aiohttp.ClientError:
        return 0, {}


async def _all_ready(
    session: aiohttp.ClientSession, metrics_port: int, proc: asyncio.subprocess.Process, log: Path
) -> None:
    """Until the host's /readyz says both processes are ready."""
    for _ in range(400):
        assert proc.returncode is None, log.read_text()  # noqa: ASYNC240 - failing anyway
        status, body = await _readyz(session, metrics_port)
        if status == 200 and body.get("processes") == {"0": "ready", "1": "ready"}:
            return
        await asyncio.sleep(0.05)  # paces the polling
    raise AssertionError(f"not both ready: {log.read_text()}")  # noqa: ASYNC240 - failing anyway


@contextlib.asynccontextmanager
async def _serving(
    env: dict[str, str], log: Path, metrics_port: int
) -> AsyncIterator[tuple[asyncio.subprocess.Process, aiohttp.ClientSession]]:
    """``dispenser serve --processes 2`` spawned, and a session to it once both processes are ready."""
    async with spawned(_SERVE, env, log) as proc, aiohttp.ClientSession() as session:
        await _all_ready(session, metrics_port, proc, log)
        yield proc, session


async def _http_id(http_port: int, kind: str) -> int:
    """One ID over HTTP on a connection of its own (the kernel picks the process per connection)."""
    connector = aiohttp.TCPConnector(force_close=True)
    url = f"http://127.0.0.1:{http_port}/api/{kind}/get/{_TAG}"
    async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return int(await response.text())


def _counter(metrics: str, kind: str, process: str) -> float:
    pattern = rf'^leaf_requests_total\{{[^}}]*kind="{kind}"[^}}]*process="{process}"[^}}]*\}} (\S+)$'
    found = [float(m) for m in re.findall(pattern, metrics, re.MULTILINE)]
    return sum(found)


@pytest.mark.nats
async def test_two_processes_share_the_http_port_and_the_queue_group_with_ids_unique_across_them(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Both processes answer HTTP and NATS, each under its own worker ID, no ID twice; one /metrics shows both."""
    await prepare(pg_dsn, [(_TAG, 1000)])
    http_port, metrics_port = free_port(), free_port()
    env = _env(nats_server.url, pg_dsn, tmp_path, http_port, metrics_port)
    log = tmp_path / "serve.log"
    async with _serving(env, log, metrics_port) as (proc, session):
        segment_ids = [await _http_id(http_port, "segment") for _ in range(20)]
        snowflake_ids = [await _http_id(http_port, "snowflake") for _ in range(20)]
        async with client(nats_server.url) as nc:
            for _ in range(40):
                segment_ids += ids_of(await ask(nc, f"procs.segment.{_TAG}", b'{"count": 10}'))
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            metrics = await response.text()
        status = await stopped_by_sigterm(proc)
    text = log.read_text()
    assert status == 0, text
    assert len(segment_ids) == len(set(segment_ids)) == 420
    assert len(set(snowflake_ids)) == 20
    layout = layout_of(load_config(environ=env).snowflake)
    workers = {layout.decompose(i).worker_id for i in snowflake_ids}
    assert len(workers) == 2, (workers, text)  # both processes answered over the shared port, each its own ID
    logged = set(re.findall(r"process \d \(pid \d+\) serving, snowflake worker ID (\d+)", text))
    assert {int(w) for w in logged} == workers, text
    assert _counter(metrics, "segment", "0") > 0, metrics
    assert _counter(metrics, "segment", "1") > 0, metrics
    assert "leaf_worker_processes 2.0" in metrics, metrics


@pytest.mark.nats
async def test_a_process_killed_is_restarted_and_sigterm_stops_them_all(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Kill -9 of one process: logged, restarted, serving again on its own worker ID; SIGTERM: every one gone."""
    await prepare(pg_dsn, [(_TAG, 1000)])
    http_port, metrics_port = free_port(), free_port()
    env = _env(nats_server.url, pg_dsn, tmp_path, http_port, metrics_port)
    log = tmp_path / "serve.log"
    async with _serving(env, log, metrics_port) as (proc, session):
        before = [await _http_id(http_port, "segment") for _ in range(10)]
        pid = int(re.findall(r"process 1 \(pid (\d+)\) serving", log.read_text())[0])
        os.kill(pid, 9)
        await wait_until(lambda: "killed by SIGKILL" in log.read_text(), what="the death logged")
        await _all_ready(session, metrics_port, proc, log)
        after = [await _http_id(http_port, "segment") for _ in range(10)]
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            metrics = await response.text()
        pids = {int(p) for p in re.findall(r"process \d \(pid (\d+)\) serving", log.read_text())}
        status = await stopped_by_sigterm(proc)
    text = log.read_text()
    assert status == 0, text
    assert re.search(rf"process 1 \(pid {pid}\) killed by SIGKILL after [\d.]+ s: restarting it in", text), (
        text
    )
    assert 'leaf_worker_process_restarts_total{process="1"} 1.0' in metrics, metrics
    assert len(set(before + after)) == 20
    assert len(pids) == 3, text  # process 0, process 1, and process 1 again
    for each in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(each, 0)  # every process gone with the supervisor's exit


@pytest.mark.kafka
async def test_two_processes_share_the_kafka_request_topic_with_ids_unique_across_them(
    kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path
) -> None:
    """Kafka only: both processes join the consumer group and answer requests; no ID of a tag twice."""
    tags = [f"t{i}" for i in range(8)]
    await prepare(pg_dsn, [(tag, 50) for tag in tags])
    metrics_port = free_port()
    env = kafka_env(
        kafka_broker.bootstrap,
        pg_dsn,
        **serving_topics(),
        metrics_port=metrics_port,
        snowflake_state_dir=tmp_path / "state",
        log_level="INFO",
    )
    config = load_config(environ=env)
    await create_topics(kafka_broker.bootstrap, {config.kafka.request_topic: 4})
    log = tmp_path / "serve.log"
    replies: list[list[int]] = []
    async with _serving(env, log, metrics_port) as (proc, session):
        async with KafkaIdClient(config.kafka, timeout=30.0) as kafka_client:
            for _ in range(50):  # until both have answered: the group settles on both members by itself
                replies += await asyncio.gather(*(kafka_client.ids(tag, 7) for tag in tags))
                async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                    metrics = await response.text()
                if _counter(metrics, "segment", "0") and _counter(metrics, "segment", "1"):
                    break
        status = await stopped_by_sigterm(proc)
    assert status == 0, log.read_text()
    assert _counter(metrics, "segment", "0") > 0, metrics
    assert _counter(metrics, "segment", "1") > 0, metrics
    per_tag: dict[int, list[int]] = {}
    for n, ids in enumerate(replies):
        per_tag.setdefault(n % len(tags), []).extend(ids)
    for ids in per_tag.values():
        assert len(ids) == len(set(ids))


@pytest.mark.nats
async def test_a_process_that_does_not_stop_within_the_budget_is_killed(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM with one process frozen: the other stops, the frozen one is killed at the budget, exit 1."""
    await prepare(pg_dsn, [(_TAG, 1000)])
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_NATS_SUBJECT_PREFIX": "budget",
        "DISPENSER_NATS_SERVICE_NAME": "budget",
        "DISPENSER_POSTGRES_DSN": pg_dsn,
        "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_SEGMENT_RESIDUE_CHECK_WINDOW": "0.05",
    }
    config = load_config(environ=env)
    caplog.set_level(logging.INFO, "dispenser.supervisor")
    # This process is the supervisor (its signal handlers on this loop), with a short budget to wait out.
    prepare_logging = functools.partial(logging.basicConfig, level="WARNING")
    supervising = asyncio.create_task(supervise(config, 2, prepare=prepare_logging, stop_budget=1.0))
    async with client(nats_server.url) as nc:
        await wait_serving(nc, 2, service="budget")
    running = {p.name: p.pid for p in multiprocessing.active_children() if p.pid is not None}
    workers = [running[f"dispenser-worker-{index}"] for index in (0, 1)]
    sigstop(workers[1])
    os.kill(os.getpid(), signal.SIGTERM)  # taken by the supervisor's handler on this loop
    status = await asyncio.wait_for(supervising, 10)
    assert status == 1
    assert f"process 1 (pid {workers[1]}) did not stop within 1 s: killed" in caplog.text
    for each in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(each, 0)


async def test_the_processes_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    """SIGKILL to the supervisor: each process sees its socket to it close, says so and stops cleanly."""
    http_port, metrics_port = free_port(), free_port()
    env = {
        "DISPENSER_NATS_ENABLED": "false",
        "DISPENSER_SEGMENT_ENABLED": "false",
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_PER_PROCESS_WORKER_IDS": "true",  # static worker IDs 0 and 1
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_HTTP_PORT": str(http_port),
        "DISPENSER_METRICS_PORT": str(metrics_port),
        "DISPENSER_LOG_LEVEL": "INFO",
    }
    log = tmp_path / "serve.log"
    async with _serving(env, log, metrics_port) as (proc, _session):
        proc.kill()
        await proc.wait()

        def gone() -> bool:
            text = log.read_text()
            return text.count("the supervisor is gone: stopping") == 2 and text.count(": stopped") == 2

        await wait_until(gone, what="both processes stopped")
    with pytest.raises(aiohttp.ClientError):  # nothing listens on the port they shared
        await _http_id(http_port, "snowflake")


async def test_a_process_that_cannot_start_stops_the_supervisor_with_exit_status_1(tmp_path: Path) -> None:
    """A start refused (a snowflake layout of 72 bits): not restarted; the supervisor exits 1 as one worker would."""
    env = {
        "DISPENSER_NATS_ENABLED": "false",
        "DISPENSER_SEGMENT_ENABLED": "false",
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_MODE": "postgres",
        "DISPENSER_SNOWFLAKE_WORKER_BITS": "19",  # 41 + 19 + 12 bits: no 63-bit layout
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(tmp_path / "state"),
        "DISPENSER_HTTP_PORT": str(free_port()),
        "DISPENSER_LOG_LEVEL": "INFO",
    }
    log = tmp_path / "serve.log"
    async with spawned(_SERVE, env, log) as proc:
        status = await asyncio.wait_for(proc.wait(), 30)
    text = log.read_text()
    assert status == 1, text
    assert re.search(r"process \d could not start \(exited with status 1\): stopping", text), text
    assert "restarting" not in text, text
