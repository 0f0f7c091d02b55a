"""Helpers for the segment end-to-end tests: a worker in this process or in a child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import asyncpg
import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.config import Config, load_config
from dispenser.messages import Reply
from dispenser.ports import Clock
from dispenser_lab.servers.process import sigstop


def worker_config(nats_url: str, dsn: str, **segment: object) -> Config:
    """A config for tests: the given servers, fast refresh, and any segment overrides."""
    env = {"DISPENSER_NATS_URL": nats_url, "DISPENSER_POSTGRES_DSN": dsn}
    env |= {f"DISPENSER_SEGMENT_{k.upper()}": str(v) for k, v in segment.items()}
    return load_config(environ=env)


async def prepare(dsn: str, tags: Iterable[tuple[str, int]]) -> None:
    """Migrate and add tags ``(name, step)``."""
    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, step in tags:
            await store.add_tag(tag, step)


@contextlib.asynccontextmanager
async def running_worker(config: Config, clock: Clock | None = None) -> AsyncIterator[Worker]:
    """A worker serving in this event loop (on ``clock``, the real one by default), stopped afterwards.

    A start that fails has released what it opened (see :meth:`Worker.start`) and raises here.
    """
    async with Worker(config, clock) as worker:
        yield worker


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    """A plain nats-py client."""
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


async def request(
    nc: Client, subject: str, body: bytes = b"", timeout: float = 5.0, headers: dict[str, str] | None = None
) -> Msg:
    """``nc.request``, retrying "no responders" for up to a second.

    nats-server sometimes answers "no responders" for a few milliseconds after another connection's
    subscription was flushed (about 3 first requests in 100 here, with plain nats-py too). No worker saw such
    a request, so sending it again is safe.
    """
    deadline = time.monotonic() + 1.0
    while True:
        try:
            return await nc.request(subject, body, timeout=timeout, headers=headers)
        except NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


async def no_responders_soon(nc: Client, subject: str, within: float = 3.0) -> None:
    """Assert that requests to ``subject`` soon get "no responders" (nobody listens any more).

    Right after an UNSUB, nats-server may still route a publisher's message to the old subscription for a
    moment (the mirror of the early "no responders" after a SUB, see :func:`request`): such a request is
    dropped and times out, so this asks again until the server says no one is there.

    Raises:
        AssertionError: something still answered, or no "no responders" within ``within`` seconds.
    """
    deadline = time.monotonic() + within
    while True:
        try:
            msg = await nc.request(subject, b"", timeout=0.25)
        except NoRespondersError:
            return
        except nats.errors.TimeoutError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{subject}: still no 'no responders' after {within:g} s") from None
            continue
        raise AssertionError(f"{subject}: answered after it should have stopped: {msg.data!r}")


async def wait_until(condition: Callable[[], bool], *, what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` (every 10 ms) until it holds: a test waits for a state, never for a guessed time.

    Raises:
        AssertionError: it did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.01)


async def ask(nc: Client, subject: str, body: bytes = b"", timeout: float = 5.0) -> Reply:
    """Send one request (see :func:`request`) and decode the reply."""
    msg = await request(nc, subject, body, timeout)
    return msgspec.json.decode(msg.data, type=Reply)


def ids_of(reply: Reply) -> list[int]:
    """The IDs of a successful reply, whichever format it used."""
    assert reply.error is None, reply.error
    if reply.ranges is not None:
        return [i for first, last in reply.ranges for i in range(first, last + 1)]
    assert reply.ids is not None
    return reply.ids


class WorkerProcess:
    """``dispenser serve`` in a child process, for SIGKILL and SIGTERM tests."""

    def __init__(self, nats_url: str, dsn: str, log_path: Path, **env: str) -> None:
        self.env = os.environ | {
            "DISPENSER_NATS_URL": nats_url,
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_LOG_LEVEL": "INFO",
        }
        self.env |= env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the worker (readiness is waited for with :meth:`wait_ready`)."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dispenser", "serve"], env=self.env, stdout=log, stderr=log
        )
        log.close()

    async def wait_ready(self, nc: Client, subject: str, timeout: float = 20.0) -> None:
        """Wait until the worker answers on ``subject`` (any reply counts)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"worker exited with {self.proc.returncode}: {self.log_path.read_text()}"
                )
            try:
                await nc.request(subject, b"", timeout=0.5)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker not ready: {self.log_path.read_text()}") from None
                await asyncio.sleep(0.1)
            else:
                return

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal to the worker we started (SIGSTOP: returns once it has stopped, as ``sigstop``)."""
        assert self.proc is not None
        if sig == signal.SIGSTOP:
            sigstop(self.proc.pid)
        else:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 15.0) -> int:
        """Wait for exit; returns the exit status."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Stop it if it still runs (SIGTERM, then SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def wait_serving(
    nc: Client, workers: int, timeout: float = 20.0, service: str = "leaf-dispenser"
) -> None:
    """Wait until ``workers`` workers answer ``$SRV.PING`` (each serving: its NATS service started).

    :meth:`WorkerProcess.wait_ready` is satisfied by any worker's reply, so with several workers started at
    once it may return while the slower ones are still starting (a start waits for its peer checks: the
    snowflake clock and residue windows), and a short test would then run against one of them only.
    """
    deadline = time.monotonic() + timeout
    while True:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        seen = set()
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            while True:
                msg = await sub.next_msg(timeout=0.3)
                seen.add(msg.data)
        await sub.unsubscribe()
        if len(seen) >= workers:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(seen)} of {workers} workers serving after {timeout} s")


def whole(msg: Msg) -> str:
    """Everything a NATS caller receives: the body and every header."""
    headers = " ".join(f"{k}: {v}" for k, v in (msg.headers or {}).items())
    return f"{msg.data.decode()} {headers}"


def assert_nowhere(text: str, what: str, whereabouts: Iterable[str]) -> None:
    """None of ``whereabouts`` (a DSN's parts, a server's address, a path) is in ``text``."""
    found = [part for part in whereabouts if part in text]
    assert not found, f"{what} says {found}: {text}"


@contextlib.asynccontextmanager
async def spawned(
    args: list[str], env: dict[str, str], log_path: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A process we started (``args``, ``env`` over ours, output in ``log_path``), killed if the test left it running."""
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(*args, env=os.environ | env, stdout=log, stderr=log)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def wait_answering(nc: Client, subject: str, proc: asyncio.subprocess.Process, log_path: Path) -> None:
    """Until the worker ``proc`` answers a one-ID request on ``subject`` (its start: up to ~30 s when loaded)."""
    for _ in range(300):
        # The log is read only when the assertion fails (the message is evaluated then): no blocking read here.
        assert proc.returncode is None, log_path.read_text()  # noqa: ASYNC240
        try:
            assert ids_of(await ask(nc, subject, b'{"count": 1}', timeout=0.5))
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.1)
    raise AssertionError(f"no answer on {subject}: {log_path.read_text()}")  # noqa: ASYNC240 - failing anyway


async def stopped_by_sigterm(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM, then the exit status within the 10 s every process must stop in (TimeoutError past it)."""
    proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 10)


async def rewind(dsn: str, tag: str, max_id: int) -> None:
    """Set ``tag``'s ``max_id`` back to ``max_id``, as a primary that lost grants (or a restore) would have it."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE leaf_alloc SET max_id = $2 WHERE biz_tag = $1", tag, max_id)
    finally:
        await conn.close()
