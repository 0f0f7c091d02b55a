"""The load side of ``dispenser bench nats``: the responder processes, the load generator, its samples.

:class:`Child` starts and stops a responder by its own PID; :func:`wait_ready` waits until it answers;
:func:`drive` keeps N requests in flight and returns a :class:`Sample` (latencies, errors, CPU times);
:func:`sampled_count_check` and :class:`SwitchSplit` check the replies as they come; :func:`make_case`
turns a sample into the report's case record.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dispenser.messages import Reply
from dispenser.runner import run_async
from dispenser_lab.bench.nats_plan import SWITCH_START, BenchError, Body
from dispenser_lab.bench.servers import prepare_tags, remove_tags
from dispenser_lab.bench.stats import CaseResult, summarize
from dispenser_lab.servers.process import log_tail, stop_process

__all__ = [
    "Child",
    "ReplyCheck",
    "Sample",
    "SwitchSplit",
    "count_ids",
    "cpu_times",
    "drive",
    "make_case",
    "sampled_count_check",
    "serving_worker",
    "wait_ready",
]

# -- child processes ---------------------------------------------------------------------------------


class Child:
    """A responder process we started; stopped (SIGTERM, then SIGKILL) by its PID and no other."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process, its output going to :attr:`log_path`."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                # Its own session: a Ctrl-C meant for the bench reaches it only through our stop().
                start_new_session=True,
            )

    @property
    def exited(self) -> bool:
        """Whether the process was started and has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit status (``None`` if never started)."""
        if self.proc is None:
            return None
        return stop_process(self.proc, [(signal.SIGTERM, timeout)])

    def tail(self, lines: int = 30) -> str:
        """The last lines of the process's output."""
        return log_tail(self.log_path, lines)


async def wait_ready(nc: Client, child: Child, subject: str, payload: bytes, timeout: float = 30.0) -> None:
    """Wait until ``child`` answers ``payload`` on ``subject`` without an error.

    Raises:
        BenchError: the process exited, or did not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last = "no reply"
    while True:
        if child.exited:
            raise BenchError(f"{child.name} exited with status {child.stop()}:\n{child.tail()}")
        try:
            msg = await nc.request(subject, payload, timeout=0.5)
        except (NoRespondersError, NatsTimeout) as exc:
            last = type(exc).__name__
        else:
            if not msg.headers:
                return
            last = msg.data.decode(errors="replace")
        if time.monotonic() > deadline:
            raise BenchError(
                f"{child.name} did not answer on {subject} within {timeout:g}s ({last}):\n{child.tail()}"
            )
        await asyncio.sleep(0.1)


# -- the load generator ------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """What one measured window saw."""

    latencies_ns: list[int]
    elapsed: float
    errors: int
    timeouts: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system) each watched process used in the window, by name."""

    @property
    def rate(self) -> float:
        """Good replies per second."""
        return len(self.latencies_ns) / self.elapsed if self.elapsed > 0 else 0.0

    def merge(self, other: Sample) -> Sample:
        """Both windows as one (latencies pooled, durations and errors added up)."""
        return Sample(
            self.latencies_ns + other.latencies_ns,
            self.elapsed + other.elapsed,
            self.errors + other.errors,
            self.timeouts + other.timeouts,
            {name: used + other.cpu_s.get(name, 0.0) for name, used in self.cpu_s.items()},
        )

    def cpu_share(self) -> dict[str, float]:
        """Each watched process's CPU use as a share of one core (1.0 = one core busy all the time)."""
        if self.elapsed <= 0:
            return {}
        return {name: round(used / self.elapsed, 3) for name, used in self.cpu_s.items()}


ReplyCheck = Callable[[Msg, int], bool]
"""Called with each measured reply and its latency (ns); ``False`` counts the reply as an error."""


async def drive(
    nc: Client,
    subject: str,
    payload: bytes | Callable[[], bytes],
    *,
    inflight: int,
    warmup: float,
    duration: float,
    timeout: float,
    check: ReplyCheck | None = None,
    watch: dict[str, int] | None = None,
) -> Sample:
    """Keep ``inflight`` requests outstanding for ``warmup + duration`` seconds; measure the last part.

    Each of ``inflight`` coroutines sends a request with ``nc.request`` and waits for its reply before
    sending the next. Replies that arrive while measuring are counted: their latencies (send to reply,
    as the requester sees it) and, through ``check``, whether they are right. A reply with headers is an
    error reply (the dispenser's carry ``Nats-Service-Error``; the echo's and successful ones have none).
    ``payload`` may be a function that makes each request's body (a fresh ``request_id`` each).

    Raises:
        BenchError: nobody answers on ``subject`` any more.
    """
    latencies: list[int] = []
    record = latencies.append
    errors = 0
    timeouts = 0
    measuring = False
    stopping = False

    if isinstance(payload, bytes):
        fixed = payload

        def make() -> bytes:
            return fixed
    else:
        make = payload

    async def requester() -> None:
        nonlocal errors, timeouts
        request = nc.request
        clock = time.perf_counter_ns
        while not stopping:
            started = clock()
            try:
                msg = await request(subject, make(), timeout=timeout)
            except NatsTimeout:
                if measuring:
                    timeouts += 1
                continue
            latency = clock() - started
            if not measuring:
                continue
            if msg.headers or (check is not None and not check(msg, latency)):
                errors += 1
            else:
                record(latency)

    tasks = [asyncio.create_task(requester()) for _ in range(inflight)]
    try:
        await asyncio.sleep(warmup)
        cpu_before = cpu_times(watch or {})
        measuring = True
        began = time.perf_counter()
        await asyncio.sleep(duration)
        measuring = False
        elapsed = time.perf_counter() - began
        cpu_after = cpu_times(watch or {})
        stopping = True
        await asyncio.gather(*tasks)
    except NoRespondersError:
        raise BenchError(f"no responder on {subject} any more") from None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    used = {name: cpu_after[name] - cpu_before[name] for name in cpu_after if name in cpu_before}
    return Sample(latencies, elapsed, errors, timeouts, used)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_times(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process, from ``/proc`` (Linux; others are left out).

    The bench's own process is read with :func:`time.process_time` whatever its entry says.
    """
    times: dict[str, float] = {}
    for name, pid in pids.items():
        if pid == os.getpid():
            times[name] = time.process_time()
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces; the fields after its closing parenthesis don't.
        fields = stat[stat.rindex(")") + 2 :].split()
        times[name] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)
    return times


_reply_decoder = msgspec.json.Decoder(Reply)


def count_ids(data: bytes) -> int:
    """How many IDs a dispenser reply carries (0 for an error reply)."""
    reply = _reply_decoder.decode(data)
    if reply.ids is not None:
        return len(reply.ids)
    if reply.ranges is not None:
        return sum(last - first + 1 for first, last in reply.ranges)
    return 0


def sampled_count_check(count: int, every: int = 256) -> ReplyCheck:
    """Decode every ``every``-th reply and check it holds ``count`` IDs (decoding all would load the client)."""
    seen = 0

    def check(msg: Msg, _latency: int) -> bool:
        nonlocal seen
        seen += 1
        return seen % every != 1 or count_ids(msg.data) == count

    return check


@dataclass(slots=True)
class SwitchSplit:
    """Latencies of replies that landed on a segment switch-over, and of the others."""

    step: int
    count: int
    start: int = SWITCH_START
    switch_ns: list[int] = field(default_factory=list)
    steady_ns: list[int] = field(default_factory=list)

    def check(self, msg: Msg, latency: int) -> bool:
        """Classify one reply: a switch-over when it holds the first ID of a segment."""
        reply = _reply_decoder.decode(msg.data)
        ids = reply.ids
        if not ids or len(ids) != self.count:
            return False
        first = ids[0] - self.start
        last = ids[-1] - self.start
        if first % self.step == 0 or first // self.step != last // self.step:
            self.switch_ns.append(latency)
        else:
            self.steady_ns.append(latency)
        return True


def make_case(
    *,
    name: str,
    responder: str,
    kind: str,
    mode: str | None,
    subject: str,
    body: Body,
    inflight: int,
    step: int | None,
    sample: Sample,
    repetitions: int = 1,
) -> CaseResult:
    """The case record of one measured window (or of several pooled)."""
    lat = summarize(sample.latencies_ns)
    rate = sample.rate
    cpu = sample.cpu_share()
    return CaseResult(
        name=name,
        responder=responder,
        kind=kind,
        mode=mode,
        subject=subject,
        format=body.format,
        count=body.count,
        inflight=inflight,
        step=step,
        duration_s=round(sample.elapsed, 3),
        requests=lat.n,
        errors=sample.errors,
        timeouts=sample.timeouts,
        requests_per_s=round(rate, 1),
        ids_per_s=None if responder == "echo" else round(rate * body.count, 1),
        p50_ms=lat.p50_ms,
        p99_ms=lat.p99_ms,
        p999_ms=lat.p999_ms,
        max_ms=lat.max_ms,
        repetitions=repetitions,
        cpu_responder=cpu.get("responder"),
        cpu_loadgen=cpu.get("loadgen"),
        cpu_nats=cpu.get("nats"),
        responder_us_per_request=(
            round(cpu["responder"] / rate * 1e6, 2) if "responder" in cpu and rate > 0 else None
        ),
    )


@contextlib.contextmanager
def serving_worker(
    url: str,
    dsn: str,
    workdir: Path,
    tags: Sequence[tuple[str, int, int]],
    say: Callable[[str], None],
    *,
    settings: Mapping[str, str] | None = None,
) -> Iterator[Child]:
    """A ``dispenser serve`` child process on ``url`` and ``dsn``, with ``tags`` added for it (removed after).

    Segment mode only, logs at WARNING, its state under ``workdir``, ``settings`` (``DISPENSER_*``) on top.
    On exit the worker is stopped (an unclean exit is said, with the tail of its log) and the tags removed.
    """
    run_async(prepare_tags(dsn, tags))
    env = dict(os.environ) | {
        "DISPENSER_NATS_URL": url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_LOG_LEVEL": "WARNING",
        "DISPENSER_SNOWFLAKE_ENABLED": "false",
        "XDG_STATE_HOME": str(workdir / "state"),
        **(settings or {}),
    }
    child = Child(
        "dispenser worker", [sys.executable, "-m", "dispenser", "serve"], workdir / "worker.log", env
    )
    child.start()
    try:
        yield child
    finally:
        status = child.stop()
        if status not in (None, 0):
            say(f"dispenser worker exited with status {status}:\n{child.tail()}")
        run_async(remove_tags(dsn, tags))
