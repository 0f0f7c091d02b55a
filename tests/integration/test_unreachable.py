"""Issue 22 items 1-3, NATS side: nothing waits for ever, every command stops on a signal, a silent server is left.

NATS "unreachable" comes in two kinds here: a closed port (refused at once, as a stopped server) and a
server behind a blackholed fault proxy (the TCP connection is accepted, then silence: a frozen host, a
partition). Each command and client must give up within its own timeout, with one line naming NATS and
the cause, and ``dispenser serve`` must stop on SIGTERM in every state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest

from dispenser.adapters.nats.connection import connect
from dispenser.client import BlockingIdClient, BufferSettings, DispenserUnavailable, IdClient, IdRequestError
from dispenser.config import NatsConfig
from dispenser_lab.faultproxy import FaultProxy
from dispenser_lab.servers import NatsServer, free_port
from tests.integration.segment_support import ask, ids_of, prepare, running_worker, wait_until, worker_config
from tests.secret_values import SECRETS

pytestmark = [pytest.mark.nats]

# A child Python process imports the package in ~0.5 s alone, several seconds on a loaded machine: the
# bounds below are the command's own timeout plus this, and the hang they catch is for ever.
STARTUP = 6.0


@dataclass
class Finished:
    status: int
    elapsed: float
    stderr: str


async def dispenser(args: list[str], env: Mapping[str, str], timeout: float = 60.0) -> Finished:
    """Run ``dispenser ARGS`` to its end; how it exited, how long it took, what it said on stderr."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dispenser",
        *args,
        env=os.environ | dict(env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return Finished(proc.returncode, time.monotonic() - started, err.decode(errors="replace"))


@contextlib.asynccontextmanager
async def silent_nats(server: NatsServer) -> AsyncIterator[FaultProxy]:
    """A NATS server behind a blackholed proxy: connections are accepted and never answered."""
    async with FaultProxy(("127.0.0.1", server.port)) as proxy:
        proxy.blackhole()
        yield proxy


def closed_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"  # nothing listens there


def one_line_naming_nats(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("dispenser: "), stderr
    assert "NATS" in lines[0], stderr
    return lines[0]


async def test_get_obeys_its_timeout(nats_server: NatsServer) -> None:
    """``dispenser get --timeout 2``: refused and silent NATS both end within the timeout, exit 1, one line."""
    async with silent_nats(nats_server) as proxy:
        refused, silent = await asyncio.gather(
            dispenser(["get", "order", "--timeout", "2"], {"DISPENSER_NATS_URL": closed_url()}),
            dispenser(["get", "order", "--timeout", "2"], {"DISPENSER_NATS_URL": proxy.url("nats")}),
        )
        assert proxy.accepted >= 1  # the silent one did connect: TCP was accepted
    for finished in (refused, silent):
        assert finished.status == 1, finished
        assert finished.elapsed < 2 + STARTUP, finished
    assert "within 2 s" in one_line_naming_nats(refused.stderr)
    assert "answer" in one_line_naming_nats(silent.stderr)


async def test_watch_once_obeys_its_timeout(nats_server: NatsServer) -> None:
    """``dispenser watch --once --timeout 2`` against refused and silent NATS: exit 1 in time, one line."""
    async with silent_nats(nats_server) as proxy:
        results = await asyncio.gather(
            dispenser(["watch", "--once", "--timeout", "2"], {"DISPENSER_NATS_URL": closed_url()}),
            dispenser(["watch", "--once", "--timeout", "2"], {"DISPENSER_NATS_URL": proxy.url("nats")}),
        )
    for finished in results:
        assert finished.status == 1, finished
        assert finished.elapsed < 2 + STARTUP, finished
        one_line_naming_nats(finished.stderr)


async def test_check_fails_nats_within_its_connect_timeout(nats_server: NatsServer, pg_dsn: str) -> None:
    """``dispenser check`` against a silent NATS: ``FAIL nats`` after ``nats.connect_timeout`` (1 s), exit 1."""
    await prepare(pg_dsn, [("order", 100)])
    async with silent_nats(nats_server) as proxy:
        env = {
            "DISPENSER_NATS_URL": proxy.url("nats"),
            "DISPENSER_NATS_CONNECT_TIMEOUT": "1",
            "DISPENSER_POSTGRES_DSN": pg_dsn,
        }
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dispenser",
            "check",
            env=os.environ | env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        took = time.monotonic() - started
    text = out.decode() + err.decode()
    assert proc.returncode == 1, text
    assert took < 1 + STARTUP, text
    assert "FAIL nats" in text, text
    assert "ok   postgres" in text, text


def serve_env(nats_url: str, dsn: str, **extra: str) -> dict[str, str]:
    return {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_LOG_LEVEL": "INFO",
        "DISPENSER_NATS_CONNECT_TIMEOUT": "1",
    } | extra


async def test_serve_gives_up_at_its_start_deadline(pg_dsn: str) -> None:
    """NATS on a closed port: one warning, retries until ``nats.start_deadline`` (2 s), then exit 1, one error line."""
    await prepare(pg_dsn, [("order", 100)])
    url = closed_url()
    finished = await dispenser(["serve"], serve_env(url, pg_dsn, DISPENSER_NATS_START_DEADLINE="2"))
    assert finished.status == 1, finished
    assert finished.elapsed < 2 + STARTUP, finished
    assert finished.stderr.count("cannot reach NATS") == 1, finished.stderr  # not two lines a second
    errors = [line for line in finished.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, finished.stderr
    assert f"cannot start: cannot connect to NATS at {url} within 2 s" in errors[0]


async def signal_while_starting(
    env: Mapping[str, str], tmp_path: Path, started: Callable[[Path], bool], what: str
) -> float:
    """Start ``dispenser serve``, SIGTERM it once ``started(its log)`` holds; how long it took to exit after."""
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dispenser", "serve", env=os.environ | dict(env), stdout=log, stderr=log
        )
    try:
        await wait_until(lambda: started(log_path), what=what, timeout=30)
        assert proc.returncode is None, log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        status = await asyncio.wait_for(proc.wait(), 30)
        took = time.monotonic() - signalled
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = log_path.read_text()
    assert status == 1, text
    assert "stopped by a signal before the start finished" in text, text
    assert "start interrupted while connecting to NATS" in text, text
    return took


async def test_sigterm_stops_serve_while_nats_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """SIGTERM while ``serve`` retries a closed NATS port (deadline 60 s): it exits at once, not at SIGKILL."""
    await prepare(pg_dsn, [("order", 100)])
    env = serve_env(closed_url(), pg_dsn, DISPENSER_NATS_START_DEADLINE="60")
    took = await signal_while_starting(
        env,
        tmp_path,
        lambda log: log.exists() and "cannot reach NATS" in log.read_text(),
        "serve says it cannot reach NATS",
    )
    print(f"\nserve, NATS refused: exited {took:.2f} s after SIGTERM")
    assert took < 10


async def test_sigterm_stops_serve_while_nats_is_silent(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """SIGTERM while ``serve`` waits on a NATS that accepted the connection and never answers."""
    await prepare(pg_dsn, [("order", 100)])
    async with silent_nats(nats_server) as proxy:
        env = serve_env(proxy.url("nats"), pg_dsn, DISPENSER_NATS_START_DEADLINE="60")
        took = await signal_while_starting(
            env, tmp_path, lambda _log: proxy.connections >= 1, "serve connects to the proxy"
        )
    print(f"\nserve, NATS silent: exited {took:.2f} s after SIGTERM")
    assert took < 10


async def test_sigterm_stops_serve_whose_nats_went_silent(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """A serving worker whose NATS goes silent (blackholed) still stops within 10 s of SIGTERM."""
    await prepare(pg_dsn, [("order", 100)])
    log_path = tmp_path / "serve.log"
    async with FaultProxy(("127.0.0.1", nats_server.port)) as proxy:
        env = serve_env(proxy.url("nats"), pg_dsn, DISPENSER_NATS_SUBJECT_PREFIX="silent")
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "dispenser", "serve", env=os.environ | env, stdout=log, stderr=log
            )
        try:
            nc = await nats.connect(nats_server.url)
            try:
                deadline = time.monotonic() + 30
                while True:
                    assert proc.returncode is None, log_path.read_text()
                    try:
                        assert ids_of(await ask(nc, "silent.segment.order", b'{"count": 1}', timeout=0.5))
                        break
                    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                        assert time.monotonic() < deadline, log_path.read_text()
                        await asyncio.sleep(0.1)
            finally:
                await nc.close()
            proxy.blackhole()
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            status = await asyncio.wait_for(proc.wait(), 30)
            took = time.monotonic() - signalled
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    print(f"\nserve, NATS went silent while serving: exited {took:.2f} s after SIGTERM (status {status})")
    assert took < 10, log_path.read_text()


@pytest.mark.parametrize("kind", ["refused", "silent"])
async def test_clients_raise_unavailable_within_their_timeout(nats_server: NatsServer, kind: str) -> None:
    """``async with IdClient.over_nats(...)`` and ``BlockingIdClient.start()``: DispenserUnavailable in time."""
    settings = BufferSettings(timeout=1.0)
    async with contextlib.AsyncExitStack() as stack:
        if kind == "refused":
            url = closed_url()
        else:
            url = (await stack.enter_async_context(silent_nats(nats_server))).url("nats")
        started = time.monotonic()
        with pytest.raises(DispenserUnavailable) as caught:
            async with IdClient.over_nats(NatsConfig(url=url), settings):
                pass
        took = time.monotonic() - started
        assert took < 1.0 + 0.5, took
        assert caught.value.code == "unreachable"
        assert "NATS" in caught.value.message

        def blocking() -> float:
            client = BlockingIdClient.over_nats(url, settings)
            started = time.monotonic()
            with pytest.raises(DispenserUnavailable):
                client.start()
            return time.monotonic() - started

        took = await asyncio.to_thread(blocking)
        assert took < 1.0 + 0.5, took


async def test_a_bad_tag_name_is_refused_at_once(nats_server: NatsServer) -> None:
    """The buffered client raises the coded ``invalid_tag`` before any request, and retries nothing."""
    async with IdClient.over_nats(nats_server.url) as client:
        for call in (
            client.next_id("bad tag!"),
            client.take("bad tag!", 3),
            client.next_id("bad tag!", kind="snowflake"),
        ):
            with pytest.raises(IdRequestError) as caught:
                await asyncio.wait_for(call, 1)
            assert caught.value.code == "invalid_tag"
            assert not caught.value.retryable
            assert not isinstance(caught.value, DispenserUnavailable)
        assert client.stats("bad tag!") is None  # no buffer, no refill left running in the background


# nats-py leaves the socket of a reconnect attempt that timed out (against the silent server) to the
# garbage collector, whose StreamWriter then warns "unclosed": its leak, not the worker's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_silent_nats_connection_is_left_for_another_server(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's server goes silent (blackholed): pings notice it in seconds, and it serves through another.

    Two proxies to one server stand for two nodes. The server pings its clients every second too, so it
    drops the silent connection's subscription, which would otherwise still get half the requests. With
    pings every second and two outstanding, the silence is noticed within 3 s; a reconnect attempt that
    picks the silent server again costs ``connect_timeout`` (1 s here).
    """
    await prepare(pg_dsn, [("order", 100)])
    with NatsServer(tmp_path / "nats", config='ping_interval: "1s"\nping_max: 2\n') as server:
        async with (
            FaultProxy(("127.0.0.1", server.port)) as one,
            FaultProxy(("127.0.0.1", server.port)) as two,
        ):
            config = worker_config(f"{one.url('nats')},{two.url('nats')}", pg_dsn)
            config = msgspec.structs.replace(
                config,
                nats=msgspec.structs.replace(
                    config.nats, ping_interval=1, max_outstanding_pings=2, connect_timeout=1.0
                ),
            )
            async with running_worker(config) as worker, contextlib.AsyncExitStack() as stack:
                nc = await nats.connect(server.url)
                stack.push_async_callback(nc.close)
                assert ids_of(await ask(nc, "leaf.segment.order", b'{"count": 1}'))
                assert worker.nc.connected_url is not None
                on, other = (one, two) if worker.nc.connected_url.port == one.port else (two, one)
                on.blackhole()
                silenced = time.monotonic()
                answered_at = None
                while answered_at is None:
                    assert time.monotonic() - silenced < 20, "no answer within 20 s of the silence"
                    try:
                        reply = await ask(nc, "leaf.segment.order", b'{"count": 1}', timeout=0.5)
                    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                        await asyncio.sleep(0.05)  # the worker between servers: nobody subscribed
                        continue
                    if worker.nc.connected_url is not None and worker.nc.connected_url.port == other.port:
                        assert ids_of(reply)
                        answered_at = time.monotonic()
                took = answered_at - silenced
    print(f"\nsilent NATS connection: serving through the other server {took:.2f} s after the silence")
    assert took < 20


async def test_a_refused_credential_ends_the_start_at_once(tmp_path: Path) -> None:
    """A wrong token is not an outage: the start ends at the server's refusal, not at its 30 s deadline."""
    with NatsServer(
        tmp_path / "nats",
        config="authorization { token: $LEAF_TOKEN }",
        env={"LEAF_TOKEN": SECRETS["nats_token"]},
    ) as server:
        config = NatsConfig(url=server.url, token=SECRETS["nats_token"][::-1], start_deadline=30.0)
        started = time.monotonic()
        with pytest.raises(OSError, match="Authorization Violation") as caught:
            await connect(config, name="wrong-token")
        took = time.monotonic() - started
    assert took < 5, took
    assert "within" not in str(caught.value)  # refused, not timed out
    assert SECRETS["nats_token"][::-1] not in str(caught.value)
