"""``dispenser bench nats``: the dispenser worker against a trivial echo responder, over one NATS server.

What runs, all on this machine:

* one NATS server and one PostgreSQL server, started here in a temporary directory (or the ones named
  by ``--nats-url`` / ``--postgres-dsn``), stopped at the end;
* the echo responder (:mod:`dispenser.bench.echo`) and the dispenser worker (``python -m dispenser
  serve``), each in a process of its own, both started here and stopped by the PID we started;
* the load generator, in this process on uvloop: N requester coroutines sharing one connection, each
  sending with ``nc.request`` (nats-py's shared reply inbox) and waiting for the reply before the next.

Cases (each warmed up, then measured for a fixed duration):

* throughput: echo and dispenser, 1 and 64 requests in flight, bodies ``{"count": 1}``,
  ``{"count": 100}`` and ``{"count": 10000, "format": "ranges"}``. The echo gets the very same bodies.
  Where the dispenser's reply is much larger than the body (100 IDs as JSON), a "sized" echo that answers
  with as many bytes as the dispenser does tells the worker's own cost from what the payload costs the
  client and the server.
* switch-over: a tag with a small step (1,000 IDs, 10 per request: a new segment every 100 requests),
  against a reference run of the same body on the large-step tag. A reply that holds the first ID of a
  segment landed on a switch-over; its latency is compared with the other replies of the same run.

The modes are the dispenser's generators. ``segment`` is the one there is; ``snowflake`` has its place in
:func:`plan_for_mode` and will use ``<prefix>.snowflake.<tag>`` without the switch-over cases.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import io
import os
import platform
import pstats
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dispenser.bench.stats import (
    CaseResult,
    Target,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    fmt_us,
    ratio,
    render_table,
    summarize,
    write_json,
)
from dispenser.devservers._process import log_tail, stop_process
from dispenser.messages import Reply
from dispenser.runner import run_async

__all__ = ["BenchError", "BenchOptions", "main", "parse_options", "run"]

Format = Literal["ids", "ranges"]

STEADY_START = 10**12
"""First ID of the large-step tag: every reply of a run carries IDs of the same width (13 digits), as a
tag in service for a while would, rather than growing from 1 digit as the run goes on."""
SWITCH_START = 1
"""First ID of the switch-over tag; segments are ``[start + k * step, start + (k + 1) * step - 1]``."""

RATE_TARGET = 0.85
"""The dispenser answers at least this fraction of the echo's requests/s (same run, same body)."""
IDS_TARGET = 3_000_000
"""IDs/s with 100 IDs per request."""
SWITCH_TARGET = 1.5
"""p999 of requests on a switch-over over steady p999."""
RANGES_TARGET = 0.85
"""A 10,000-ID ranges request costs "the same as 1": its requests/s over the single-ID rate."""


class BenchError(RuntimeError):
    """The benchmark could not run (a server or responder did not start, a responder went away)."""


@dataclass(frozen=True, slots=True)
class Body:
    """A request body: how many IDs, in which format."""

    format: Format
    count: int

    @property
    def label(self) -> str:
        """``ids/100``, ``ranges/10000``."""
        return f"{self.format}/{self.count}"

    def encode(self) -> bytes:
        """The JSON request body, as a client would send it."""
        if self.format == "ids":
            return msgspec.json.encode({"count": self.count})
        return msgspec.json.encode({"count": self.count, "format": self.format})


THROUGHPUT_BODIES = (Body("ids", 1), Body("ids", 100), Body("ranges", 10_000))


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    """Everything ``dispenser bench nats`` can be told (see :func:`parse_options` for the meanings)."""

    mode: str = "segment"
    duration: float = 3.0
    warmup: float = 0.5
    repeat: int = 1
    inflight: tuple[int, ...] = (1, 64)
    step: int = 1_000_000_000
    switch_step: int = 1_000
    switch_count: int = 10
    min_switches: int = 1000
    switch_max_time: float = 60.0
    timeout: float = 5.0
    nats_url: str | None = None
    postgres_dsn: str | None = None
    subject_prefix: str = "leaf"
    json_path: Path | None = None
    profile_worker: Path | None = None
    worker_command: str | None = None
    strict: bool = False
    quiet: bool = False


@dataclass(frozen=True, slots=True)
class ModePlan:
    """How the dispenser is set up and asked in one mode."""

    mode: str
    kind: str
    """The subject part: requests go to ``<prefix>.<kind>.<tag>``."""
    steady_tag: str
    steady_step: int | None
    switch_tag: str | None
    """Tag with a small step for the switch-over cases; ``None`` when the mode has no segments."""
    switch_step: int | None
    tags: list[tuple[str, int, int]] = field(default_factory=list)
    """Segment tags ``(name, step, first ID)`` to create before the worker starts (and remove afterwards)."""
    worker_env: dict[str, str] = field(default_factory=dict)


STATE_DIR_IN_WORKDIR = "<workdir>/state"
"""Stands for the bench's temporary directory in ``ModePlan.worker_env`` (the plan is made before it exists)."""


def plan_for_mode(options: BenchOptions, run_id: str) -> ModePlan:
    """The tags and worker settings of ``options.mode``.

    Raises:
        BenchError: the mode is not available yet.
    """
    if options.mode == "segment":
        steady = f"bench-{run_id}-steady"
        switch = f"bench-{run_id}-switch"
        return ModePlan(
            mode="segment",
            kind="segment",
            steady_tag=steady,
            steady_step=options.step,
            switch_tag=switch,
            switch_step=options.switch_step,
            tags=[(steady, options.step, STEADY_START), (switch, options.switch_step, SWITCH_START)],
            worker_env={
                "DISPENSER_SEGMENT_ENABLED": "true",
                "DISPENSER_SNOWFLAKE_ENABLED": "false",
                # The switch-over cases need segments of the tag's own step (1,000 IDs): the adaptive step
                # would grow them to minutes of demand and there would be nothing left to switch. The
                # rates are still measured and published, so their cost is in every figure.
                "DISPENSER_RATE_ADAPTIVE_STEP": "false",
            },
        )
    if options.mode == "snowflake":
        # One static worker ID, no segments: every request is answered from the clock.
        return ModePlan(
            mode="snowflake",
            kind="snowflake",
            steady_tag=f"bench-{run_id}",
            steady_step=None,
            switch_tag=None,
            switch_step=None,
            worker_env={
                "DISPENSER_SEGMENT_ENABLED": "false",
                "DISPENSER_SNOWFLAKE_ENABLED": "true",
                "DISPENSER_SNOWFLAKE_MODE": "static",
                "DISPENSER_SNOWFLAKE_WORKER_ID": "1",
                "DISPENSER_SNOWFLAKE_STATE_DIR": STATE_DIR_IN_WORKDIR,
            },
        )
    raise BenchError(f"unknown mode {options.mode!r}")


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
    payload: bytes,
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

    Raises:
        BenchError: nobody answers on ``subject`` any more.
    """
    latencies: list[int] = []
    record = latencies.append
    errors = 0
    timeouts = 0
    measuring = False
    stopping = False

    async def requester() -> None:
        nonlocal errors, timeouts
        request = nc.request
        clock = time.perf_counter_ns
        while not stopping:
            started = clock()
            try:
                msg = await request(subject, payload, timeout=timeout)
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


# -- the run -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    """The outcome of a run."""

    cases: list[CaseResult]
    targets: list[Target]
    meta: dict[str, Any]
    profile: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (see :mod:`dispenser.bench.stats`)."""
        return {
            **self.meta,
            "cases": [case.as_dict() for case in self.cases],
            "targets": [target.as_dict() for target in self.targets],
        }


def _say(options: BenchOptions, text: str) -> None:
    if not options.quiet:
        print(text, file=sys.stderr, flush=True)


async def _prepare_tags(dsn: str, tags: Sequence[tuple[str, int, int]]) -> None:
    from dispenser.adapters.postgres import PostgresSegmentStore  # noqa: PLC0415 - segment mode only
    from dispenser.adapters.postgres_schema import migrate  # noqa: PLC0415

    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, step, start in tags:
            await store.add_tag(tag, step, start, "created by dispenser bench; safe to remove")


async def _remove_tags(dsn: str, tags: Sequence[tuple[str, int, int]]) -> None:
    from dispenser.adapters.postgres import PostgresSegmentStore  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, _step, _start in tags:
            with contextlib.suppress(Exception):
                await store.remove_tag(tag)


def _worker_argv(profile: Path | None, command: str | None) -> list[str]:
    if command is not None:
        return shlex.split(command)
    if profile is None:
        return [sys.executable, "-m", "dispenser", "serve"]
    # cProfile writes the file when the worker exits on our SIGTERM (run_worker returns, SystemExit).
    return [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "dispenser", "serve"]


async def _measure(
    options: BenchOptions,
    nats_url: str,
    dsn: str | None,
    workdir: Path,
    plan: ModePlan,
    *,
    nats_pid: int | None,
) -> list[CaseResult]:
    prefix = options.subject_prefix
    echo_queue = f"{prefix}-bench-echo"
    echo = Child(
        "echo responder",
        [
            *(sys.executable, "-m", "dispenser.bench.echo"),
            *("--url", nats_url, "--subject", f"{prefix}.echo.>", "--queue", echo_queue),
            *("--sized-subject", f"{prefix}.echo-sized.>"),
        ],
        workdir / "echo.log",
    )
    env = dict(os.environ)
    env |= {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
        "DISPENSER_LOG_LEVEL": "WARNING",
        "DISPENSER_LOG_FORMAT": "text",
    }
    if dsn is not None:
        env["DISPENSER_POSTGRES_DSN"] = dsn
    env |= {k: v.replace(STATE_DIR_IN_WORKDIR, str(workdir / "state")) for k, v in plan.worker_env.items()}
    worker = Child(
        "dispenser worker",
        _worker_argv(options.profile_worker, options.worker_command),
        workdir / "worker.log",
        env,
    )
    steady_subject = f"{prefix}.{plan.kind}.{plan.steady_tag}"
    echo_subject = f"{prefix}.echo.{plan.steady_tag}"
    cases: list[CaseResult] = []
    nc: Client | None = None
    try:
        echo.start()
        worker.start()
        nc = await nats.connect(nats_url, name="dispenser-bench", allow_reconnect=False)
        await wait_ready(nc, echo, echo_subject, b"")
        await wait_ready(nc, worker, steady_subject, b"")
        reply_bytes: dict[Body, int] = {}
        for body in THROUGHPUT_BODIES:
            msg = await nc.request(steady_subject, body.encode(), timeout=options.timeout)
            if msg.headers or count_ids(msg.data) != body.count:
                raise BenchError(f"the worker answered {body.label} with {msg.data[:300]!r}")
            reply_bytes[body] = len(msg.data)

        async def window(subject: str, body: Body, inflight: int, check: ReplyCheck | None) -> Sample:
            responder = echo if subject.startswith(f"{prefix}.echo") else worker
            if responder.exited:
                raise BenchError(f"the {responder.name} exited during the run:\n{responder.tail()}")
            watch = {"loadgen": os.getpid()}
            if responder.proc is not None:
                watch["responder"] = responder.proc.pid
            if nats_pid is not None:
                watch["nats"] = nats_pid
            return await drive(
                nc,
                subject,
                body.encode(),
                inflight=inflight,
                warmup=options.warmup,
                duration=options.duration,
                timeout=options.timeout,
                check=check,
                watch=watch,
            )

        def record(
            name: str,
            *,
            responder: str,
            kind: str,
            subject: str,
            body: Body,
            inflight: int,
            step: int | None,
            sample: Sample,
            windows: int | None = None,
            reply: int | None = None,
        ) -> CaseResult:
            case = make_case(
                name=name,
                responder=responder,
                kind=kind,
                mode=None if responder == "echo" else plan.mode,
                subject=subject,
                body=body,
                inflight=inflight,
                step=step,
                sample=sample,
                repetitions=options.repeat if windows is None else windows,
            )
            case.reply_bytes = reply
            _say(
                options,
                f"  {name:<38} {fmt_rate(case.requests_per_s):>9} req/s  p50 {fmt_ms(case.p50_ms):>6} ms  "
                f"p999 {fmt_ms(case.p999_ms):>7} ms  errors {case.errors + case.timeouts}",
            )
            return case

        for inflight in options.inflight:
            for body in THROUGHPUT_BODIES:
                # Echo and dispenser back to back (alternating with --repeat), so that both see the same
                # machine load; of N windows each, the best by requests/s counts.
                # A reply much larger than the request (100 IDs as JSON) also costs the client and the
                # server: a second echo, answering with a canned body of the dispenser's reply size,
                # separates that from the worker's own cost.
                size = reply_bytes[body]
                sized_subject = f"{prefix}.echo-sized.{size}" if size > len(body.encode()) + 256 else None
                echo_best: Sample | None = None
                sized_best: Sample | None = None
                best: Sample | None = None
                for _ in range(options.repeat):
                    echo_best = _better(echo_best, await window(echo_subject, body, inflight, None))
                    if sized_subject is not None:
                        sized_best = _better(sized_best, await window(sized_subject, body, inflight, None))
                    check = sampled_count_check(body.count)
                    best = _better(best, await window(steady_subject, body, inflight, check))
                assert echo_best is not None
                assert best is not None
                base = record(
                    f"echo {body.label} @{inflight}",
                    responder="echo",
                    kind="throughput",
                    subject=echo_subject,
                    body=body,
                    inflight=inflight,
                    step=None,
                    sample=echo_best,
                    reply=len(body.encode()),
                )
                cases.append(base)
                sized: CaseResult | None = None
                if sized_subject is not None and sized_best is not None:
                    sized = record(
                        f"echo {body.label} @{inflight} reply {size:,} B",
                        responder="echo",
                        kind="sized",
                        subject=sized_subject,
                        body=body,
                        inflight=inflight,
                        step=None,
                        sample=sized_best,
                        reply=size,
                    )
                    cases.append(sized)
                case = record(
                    f"{plan.mode} {body.label} @{inflight}",
                    responder="dispenser",
                    kind="throughput",
                    subject=steady_subject,
                    body=body,
                    inflight=inflight,
                    step=plan.steady_step,
                    sample=best,
                    reply=size,
                )
                case.ratio_to_echo = ratio(case.requests_per_s, base.requests_per_s)
                if sized is not None:
                    case.ratio_to_sized_echo = ratio(case.requests_per_s, sized.requests_per_s)
                cases.append(case)

        if plan.switch_tag is not None and plan.switch_step is not None:
            body = Body("ids", options.switch_count)
            switch_subject = f"{prefix}.{plan.kind}.{plan.switch_tag}"
            await wait_ready(nc, worker, switch_subject, body.encode())
            for inflight in options.inflight:
                # The same body on the large-step tag (what the run would be without switch-overs), then
                # on the small-step tag; with --repeat, all windows of each are pooled.
                split = SwitchSplit(plan.switch_step, body.count)
                reference: Sample | None = None
                switching: Sample | None = None
                extra = 0
                for _ in range(options.repeat):
                    check = sampled_count_check(body.count)
                    reference = _pooled(reference, await window(steady_subject, body, inflight, check))
                    switching = _pooled(switching, await window(switch_subject, body, inflight, split.check))
                assert reference is not None
                assert switching is not None
                # A p999 needs about 1,000 samples to be more than the maximum: measure on until there are
                # --min-switches switch-overs (or --switch-max-time has passed).
                while (
                    len(split.switch_ns) < options.min_switches
                    and switching.elapsed + options.duration <= options.switch_max_time
                ):
                    switching = switching.merge(await window(switch_subject, body, inflight, split.check))
                    extra += 1
                ref_case = record(
                    f"{plan.mode} {body.label} @{inflight} step {plan.steady_step:,}",
                    responder="dispenser",
                    kind="reference",
                    subject=steady_subject,
                    body=body,
                    inflight=inflight,
                    step=plan.steady_step,
                    sample=reference,
                )
                case = record(
                    f"{plan.mode} {body.label} @{inflight} step {plan.switch_step:,}",
                    responder="dispenser",
                    kind="switch",
                    subject=switch_subject,
                    body=body,
                    inflight=inflight,
                    step=plan.switch_step,
                    sample=switching,
                    windows=options.repeat + extra,
                )
                _add_switch_figures(case, split, ref_case)
                cases += [ref_case, case]
        if worker.exited:
            raise BenchError(f"the worker exited during the run:\n{worker.tail()}")
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        worker_status = worker.stop()
        echo.stop()
        if worker_status not in (None, 0):
            _say(options, f"dispenser worker exited with status {worker_status}:\n{worker.tail()}")
    return cases


def _better(best: Sample | None, window: Sample) -> Sample:
    return window if best is None or window.rate > best.rate else best


def _pooled(pool: Sample | None, window: Sample) -> Sample:
    return window if pool is None else pool.merge(window)


def _add_switch_figures(case: CaseResult, split: SwitchSplit, reference: CaseResult) -> None:
    switch = summarize(split.switch_ns)
    steady = summarize(split.steady_ns)
    case.switch_requests = switch.n
    case.switch_p50_ms = switch.p50_ms
    case.switch_p99_ms = switch.p99_ms
    case.switch_p999_ms = switch.p999_ms
    case.steady_requests = steady.n
    case.steady_p50_ms = steady.p50_ms
    case.steady_p99_ms = steady.p99_ms
    case.steady_p999_ms = steady.p999_ms
    case.switch_ratio_p999 = ratio(switch.p999_ms, steady.p999_ms)
    case.reference_p999_ms = reference.p999_ms
    case.reference_ratio_p999 = ratio(case.p999_ms, reference.p999_ms)


def evaluate_targets(cases: Sequence[CaseResult]) -> list[Target]:
    """Compare the run with the design's performance targets."""
    targets: list[Target] = []
    by_name = {(c.responder, c.kind, c.format, c.count, c.inflight): c for c in cases}
    top = max((c.inflight for c in cases), default=0)

    def clean(*those: CaseResult) -> bool:
        return all(c.errors == 0 and c.timeouts == 0 for c in those)

    for body in THROUGHPUT_BODIES:
        case = by_name.get(("dispenser", "throughput", body.format, body.count, top))
        if case is None or case.ratio_to_echo is None:
            continue
        targets.append(
            Target(
                name=f"rate vs echo, {body.label} @{top}",
                measured=f"{fmt_ratio(case.ratio_to_echo, percent=True)} ({fmt_rate(case.requests_per_s)}/s)"
                + (
                    ""
                    if case.ratio_to_sized_echo is None
                    else f"; {fmt_ratio(case.ratio_to_sized_echo, percent=True)} of the sized echo"
                ),
                goal=f">= {RATE_TARGET:.0%} of echo",
                passed=case.ratio_to_echo >= RATE_TARGET and clean(case),
            )
        )
    for body in THROUGHPUT_BODIES[1:]:
        case = by_name.get(("dispenser", "throughput", body.format, body.count, top))
        if case is None or case.ids_per_s is None:
            continue
        targets.append(
            Target(
                name=f"IDs/s, {body.label} @{top}",
                measured=f"{fmt_rate(case.ids_per_s)} IDs/s",
                goal=f">= {IDS_TARGET:,} IDs/s (at 100 IDs/request)",
                passed=case.ids_per_s >= IDS_TARGET and clean(case),
            )
        )
    single = by_name.get(("dispenser", "throughput", "ids", 1, top))
    ranged = by_name.get(("dispenser", "throughput", "ranges", 10_000, top))
    if single is not None and ranged is not None:
        share = ratio(ranged.requests_per_s, single.requests_per_s)
        targets.append(
            Target(
                name=f"ranges/10000 costs as much as ids/1 @{top}",
                measured=f"{fmt_ratio(share, percent=True)} of the ids/1 rate",
                goal=f">= {RANGES_TARGET:.0%} of the ids/1 rate",
                passed=share is not None and share >= RANGES_TARGET and clean(ranged),
            )
        )
    for case in cases:
        if case.kind != "switch":
            continue
        targets.append(
            Target(
                name=f"p999 switch / steady @{case.inflight}",
                measured=(
                    f"{fmt_ratio(case.switch_ratio_p999)}x ({fmt_ms(case.switch_p999_ms)} / "
                    f"{fmt_ms(case.steady_p999_ms)} ms, {case.switch_requests} switches)"
                ),
                goal=f"<= {SWITCH_TARGET}x",
                passed=case.switch_ratio_p999 is not None
                and case.switch_ratio_p999 <= SWITCH_TARGET
                and clean(case),
            )
        )
        targets.append(
            Target(
                name=f"p999 step {case.step:,} / step {by_step(cases, case):,} @{case.inflight}",
                measured=(
                    f"{fmt_ratio(case.reference_ratio_p999)}x ({fmt_ms(case.p999_ms)} / "
                    f"{fmt_ms(case.reference_p999_ms)} ms)"
                ),
                goal=f"<= {SWITCH_TARGET}x",
                passed=case.reference_ratio_p999 is not None
                and case.reference_ratio_p999 <= SWITCH_TARGET
                and clean(case),
            )
        )
    return targets


def by_step(cases: Sequence[CaseResult], switch: CaseResult) -> int:
    """The step of the reference case that goes with a switch-over case."""
    for case in cases:
        if case.kind == "reference" and case.inflight == switch.inflight and case.step is not None:
            return case.step
    return 0


def render_report(report: Report) -> str:
    """The tables printed at the end of a run."""
    cases = report.cases
    out = io.StringIO()
    meta = report.meta
    out.write(
        f"dispenser bench nats — {meta['date']} — {meta['host']['cpus']} CPUs, Python "
        f"{meta['host']['python']}, {meta['settings']['duration']:g} s per case "
        f"(+{meta['settings']['warmup']:g} s warm-up) x {meta['settings']['repeat']}, load average "
        f"{meta['host']['loadavg_before'][0]:.2f} before, {meta['host']['loadavg_after'][0]:.2f} after\n\n"
    )
    rows = [
        [
            c.name,
            str(c.inflight),
            fmt_rate(c.requests_per_s),
            fmt_rate(c.ids_per_s),
            fmt_ms(c.p50_ms),
            fmt_ms(c.p99_ms),
            fmt_ms(c.p999_ms),
            fmt_ratio(c.ratio_to_echo, percent=True),
            fmt_ratio(c.ratio_to_sized_echo, percent=True),
            "/".join(fmt_ratio(x) for x in (c.cpu_responder, c.cpu_loadgen, c.cpu_nats)),
            fmt_us(c.responder_us_per_request),
            str(c.errors + c.timeouts),
        ]
        for c in cases
    ]
    headers = ["case", "in flight", "req/s", "IDs/s", "p50 ms", "p99 ms", "p999 ms", "vs echo", "vs sized"]
    headers += ["CPU resp/load/nats", "resp µs/req", "errors"]
    out.write(render_table(headers, rows) + "\n")
    switch_rows = [
        [
            c.name,
            fmt_rate(c.requests_per_s),
            str(c.switch_requests),
            fmt_ms(c.switch_p50_ms),
            fmt_ms(c.switch_p99_ms),
            fmt_ms(c.switch_p999_ms),
            fmt_ms(c.steady_p50_ms),
            fmt_ms(c.steady_p99_ms),
            fmt_ms(c.steady_p999_ms),
            fmt_ratio(c.switch_ratio_p999),
            fmt_ms(c.p999_ms),
            fmt_ms(c.reference_p999_ms),
            fmt_ratio(c.reference_ratio_p999),
        ]
        for c in cases
        if c.kind == "switch"
    ]
    if switch_rows:
        out.write(
            "\nsegment switch-overs, latency in ms: 'sw' = replies holding the first ID of a segment, "
            "'st' = the other replies of the same run,\n'all' = every reply of the run, 'ref' = the same "
            "body and concurrency on the large-step tag\n"
        )
        headers = ["case", "req/s", "switches", "sw p50", "sw p99", "sw p999", "st p50", "st p99"]
        headers += ["st p999", "sw/st p999", "all p999", "ref p999", "all/ref"]
        out.write(render_table(headers, switch_rows) + "\n")
    out.write("\ntargets\n")
    out.write(
        render_table(
            ["target", "measured", "goal", "result"],
            [[t.name, t.measured, t.goal, "PASS" if t.passed else "FAIL"] for t in report.targets],
        )
        + "\n"
    )
    if report.profile:
        out.write("\nworker profile (cProfile, by own time)\n" + report.profile)
    return out.getvalue()


def _profile_summary(path: Path, lines: int = 30) -> str:
    text = io.StringIO()
    try:
        stats = pstats.Stats(str(path), stream=text)
    except (OSError, TypeError, EOFError) as exc:
        return f"<no profile at {path}: {exc}>\n"
    stats.strip_dirs().sort_stats("tottime").print_stats(lines)
    return text.getvalue()


@contextlib.contextmanager
def _servers(
    options: BenchOptions, workdir: Path, need_postgres: bool
) -> Iterator[tuple[str, int | None, str | None]]:
    """NATS URL, NATS server PID (if we started it) and PostgreSQL DSN (if needed)."""
    from dispenser.devservers import NatsServer, PostgresServer  # noqa: PLC0415 - only when we start them

    nats_server: NatsServer | None = None
    pg_server: PostgresServer | None = None
    try:
        nats_url = options.nats_url
        if nats_url is None:
            nats_server = NatsServer(workdir / "nats")
            nats_server.start()
            nats_url = nats_server.url
        dsn = options.postgres_dsn
        if dsn is None and need_postgres:
            pg_server = PostgresServer(workdir / "pgdata")
            pg_server.start()
            dsn = pg_server.dsn
        yield nats_url, None if nats_server is None else nats_server.pid, dsn
    finally:
        if pg_server is not None:
            pg_server.stop()
        if nats_server is not None:
            nats_server.stop()


def run(options: BenchOptions) -> Report:
    """Run every case and return the report (also written to ``options.json_path`` if set).

    Raises:
        BenchError: a server or responder could not be started, or a responder went away.
    """
    from dispenser.devservers import DevServerError  # noqa: PLC0415

    run_id = secrets.token_hex(3)
    plan = plan_for_mode(options, run_id)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dispenser-bench-") as tmp:
        workdir = Path(tmp)
        if os.geteuid() == 0:
            workdir.chmod(0o755)  # PostgreSQL runs as its own user below it
        try:
            with _servers(options, workdir, need_postgres=bool(plan.tags)) as (nats_url, nats_pid, dsn):
                _say(options, f"servers: NATS {nats_url}" + (f", PostgreSQL {dsn}" if dsn else ""))
                if dsn is not None and plan.tags:
                    run_async(_prepare_tags(dsn, plan.tags))
                try:
                    cases = run_async(_measure(options, nats_url, dsn, workdir, plan, nats_pid=nats_pid))
                finally:
                    if dsn is not None and plan.tags:
                        run_async(_remove_tags(dsn, plan.tags))
        except DevServerError as exc:
            raise BenchError(f"cannot start a server: {exc}") from exc
    meta = {
        "date": started.isoformat(timespec="seconds"),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {
            "mode": options.mode,
            "duration": options.duration,
            "warmup": options.warmup,
            "repeat": options.repeat,
            "inflight": list(options.inflight),
            "step": options.step,
            "switch_step": options.switch_step,
            "switch_count": options.switch_count,
            "min_switches": options.min_switches,
            "servers": "external" if options.nats_url or options.postgres_dsn else "started by the bench",
            "profiled": options.profile_worker is not None,
            "worker_command": options.worker_command,
        },
    }
    report = Report(cases, evaluate_targets(cases), meta)
    if options.profile_worker is not None:
        report.profile = _profile_summary(options.profile_worker)
    if options.json_path is not None:
        write_json(options.json_path, report.as_dict())
    return report


# -- the command -------------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _inflight_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,64, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dispenser bench nats",
        description=(
            "Benchmark the dispenser worker against a trivial echo responder over one NATS server: "
            "requests/s, IDs/s and latency at 1 and 64 requests in flight, and segment switch-overs. "
            "Prints a table; the exit status is 0 unless --strict and a target is missed."
        ),
    )
    # Defaults are BenchOptions's, so that the command and the dataclass cannot disagree.
    parser.set_defaults(**dataclasses.asdict(BenchOptions()))
    parser.add_argument("--mode", choices=["segment", "snowflake"], help="generator")
    parser.add_argument("--duration", type=_positive_float, help="measured seconds per case")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each case")
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        help="measure each case N times, echo and dispenser alternating; report the best window by "
        "requests/s (the switch-over cases pool all N windows)",
    )
    parser.add_argument("--inflight", type=_inflight_list, help="requests in flight, e.g. 1,64 (default)")
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH", help="write the report here")
    parser.add_argument("--nats-url", help="use this NATS server (default: start one)")
    parser.add_argument("--postgres-dsn", help="use this PostgreSQL database (default: start a server)")
    parser.add_argument(
        "--subject-prefix",
        help="subject prefix of the worker (default leaf); use another on a NATS server shared with workers",
    )
    parser.add_argument(
        "--step",
        type=_positive_int,
        help="step of the steady tag (default 1e9: even ranges of 10,000 rarely switch segments)",
    )
    parser.add_argument("--switch-step", type=_positive_int, help="step of the switch-over tag")
    parser.add_argument("--switch-count", type=_positive_int, help="IDs per request on the switch-over tag")
    parser.add_argument(
        "--min-switches",
        type=int,
        help="measure the switch-over cases until this many replies landed on a switch-over (default 1000, "
        "so that their p999 is not just their maximum)",
    )
    parser.add_argument(
        "--switch-max-time",
        type=_positive_float,
        help="but measure each switch-over case for at most this many seconds (default 60)",
    )
    parser.add_argument("--timeout", type=_positive_float, help="seconds to wait for a reply")
    parser.add_argument(
        "--profile-worker",
        type=Path,
        metavar="PATH",
        help="run the worker under cProfile; write stats to PATH",
    )
    parser.add_argument(
        "--worker-command",
        metavar="CMD",
        help="start the worker with this command instead of `python -m dispenser serve` (to compare a "
        "variant; it gets the same DISPENSER_* environment)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def parse_options(argv: Sequence[str]) -> BenchOptions:
    """Options from command-line arguments (exits with usage on bad ones, like argparse does)."""
    args = _parser().parse_args(list(argv))
    if args.profile_worker is not None:
        args.profile_worker = args.profile_worker.absolute()
    return BenchOptions(**vars(args))


def main(argv: Sequence[str]) -> int:
    """``dispenser bench nats [OPTIONS]``; returns the exit status."""
    options = parse_options(argv)
    try:
        report = run(options)
    except BenchError as exc:
        print(f"dispenser bench: {exc}", file=sys.stderr)
        return 1
    print(render_report(report), end="")
    if options.json_path is not None:
        print(f"\nwrote {options.json_path}")
    missed = [t for t in report.targets if not t.passed]
    return 1 if options.strict and missed else 0
