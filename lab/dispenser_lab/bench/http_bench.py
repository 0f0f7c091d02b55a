"""``dispenser bench http``: Leaf's HTTP API of a worker against a trivial aiohttp handler, in one run.

The worker and :mod:`dispenser_lab.bench.http_echo` each in a process of their own, loaded by ``wrk``; the
cases, the rounds, the target and the figures: ``docs/benchmarks.md`` ("HTTP"). With ``--processes N``, a
``dispenser serve --processes N`` beside them, its cases in the same rounds, its server CPU the sum of its
processes' (the supervisor's included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from dispenser.runner import run_async
from dispenser.tables import fmt_ms, fmt_rate, fmt_ratio, fmt_us, render_table
from dispenser_lab.bench.nats_load import Child, cpu_times
from dispenser_lab.bench.servers import bench_servers, prepare_tags, remove_tags
from dispenser_lab.bench.stats import CaseResult, Target, ratio, write_json
from dispenser_lab.servers.process import free_port

__all__ = ["RATE_TARGET", "BenchError", "main", "run"]

RATE_TARGET = 0.9
"""Leaf's segment form answers at least this fraction of the trivial handler's requests/s (64 connections)."""

TAG = "bench-http"
_TAGS = [(TAG, 1_000_000, 1)]

_WRK_SCRIPT = """
done = function(summary, latency, requests)
  io.write(string.format('\\n{"requests": %d, "duration_us": %d, "status_errors": %d, "socket_errors": %d, '
    .. '"timeouts": %d, "p50_us": %d, "p99_us": %d, "p999_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write, summary.errors.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max))
end
"""
"""wrk's ``done`` hook: the summary as one JSON line after wrk's own report."""


class BenchError(Exception):
    """The run could not be made (no wrk, a responder that does not start or exits)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One measured path on one responder."""

    name: str
    responder: str
    """``echo`` or ``dispenser``."""
    mode: str | None
    path: str
    fmt: str
    count: int


CASES = (
    Case("echo", "echo", None, f"/api/segment/get/{TAG}", "ids", 1),
    Case("segment, Leaf's form", "dispenser", "segment", f"/api/segment/get/{TAG}", "ids", 1),
    Case("snowflake, Leaf's form", "dispenser", "snowflake", f"/api/snowflake/get/{TAG}", "ids", 1),
    Case("segment, ?count=100", "dispenser", "segment", f"/api/segment/get/{TAG}?count=100", "ids", 100),
)


@dataclass(frozen=True, slots=True)
class Options:
    """The command line."""

    connections: list[int]
    duration: int
    warmup: int
    repeat: int
    json_path: Path | None
    nats_url: str | None
    postgres_dsn: str | None
    quiet: bool
    strict: bool
    processes: int = 1
    """Worker processes of a second dispenser responder measured beside the first (1: none)."""


@dataclass(frozen=True, slots=True)
class Window:
    """What wrk saw in one measured window, and the responder's CPU meanwhile."""

    requests: int
    seconds: float
    errors: int
    timeouts: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    cpu_s: float | None

    @property
    def rate(self) -> float:
        """Answers per second (errors included in wrk's count are subtracted)."""
        return (self.requests - self.errors) / self.seconds if self.seconds > 0 else 0.0


def _say(options: Options, text: str) -> None:
    if not options.quiet:
        print(text, file=sys.stderr, flush=True)


def _wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise BenchError("wrk is not installed: apt-get install wrk (scripts/test installs it)")
    return wrk


async def _run_wrk(
    wrk: str, script: Path, url: str, connections: int, seconds: int, *, pid: int | None
) -> Window:
    """One wrk run of ``seconds`` on ``url``; ``pid``: the responder, whose CPU (its processes') is read around it."""
    before = tree_cpu_times(pid) if pid is not None else {}
    argv = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "5s", "-s", str(script), url]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    after = tree_cpu_times(pid) if pid is not None else {}
    text = out.decode(errors="replace")
    summary = next((line for line in reversed(text.splitlines()) if line.startswith("{")), None)
    if proc.returncode != 0 or summary is None:
        raise BenchError(f"wrk failed (exit status {proc.returncode}):\n{text}")
    data = json.loads(summary)
    cpu = after["responder"] - before["responder"] if "responder" in before and "responder" in after else None
    return Window(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=data["status_errors"] + data["socket_errors"],
        timeouts=data["timeouts"],
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        p999_ms=data["p999_us"] / 1000,
        max_ms=data["max_us"] / 1000,
        cpu_s=cpu,
    )


def tree_cpu_times(pid: int) -> dict[str, float]:
    """``{"responder": CPU seconds}`` of ``pid`` and every process under it (a supervisor's workers)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    times = cpu_times({str(each): each for each in tree})
    return {"responder": sum(times.values())} if str(pid) in times else {}


async def _wait_answering(child: Child, url: str, timeout: float = 60.0) -> None:
    """Wait until ``url`` answers 200 with a number (the worker has connected and fetched a segment)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while True:
            if child.exited:
                raise BenchError(f"the {child.name} exited with status {child.stop()}:\n{child.tail()}")
            try:
                async with session.get(url) as response:
                    body = await response.text()
                    if response.status == 200 and body.isdigit():
                        return
                    last = f"{response.status} {body[:200]}"
            except aiohttp.ClientError as exc:
                last = str(exc) or type(exc).__name__
            if time.monotonic() > deadline:
                raise BenchError(f"the {child.name} did not answer {url} within {timeout:g}s ({last})")
            await asyncio.sleep(0.1)


def _worker(workdir: Path, nats_url: str, dsn: str, port: int, processes: int = 1) -> Child:
    env = dict(os.environ)
    state = workdir / ("state" if processes == 1 else f"state-{processes}")
    env |= {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": "bench-http" if processes == 1 else f"bench-http-{processes}",
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(state),
        "DISPENSER_SEGMENT_STATE_DIR": str(state),
        "DISPENSER_HTTP_PORT": str(port),
        "DISPENSER_LOG_LEVEL": "WARNING",
        "DISPENSER_LOG_FORMAT": "text",
    }
    argv = [sys.executable, "-m", "dispenser", "serve"]
    if processes > 1:
        # Static worker IDs 1 … N beside the single worker's 0 (the peer check would refuse a shared one).
        env |= {"DISPENSER_SNOWFLAKE_WORKER_ID": "1", "DISPENSER_SNOWFLAKE_PER_PROCESS_WORKER_IDS": "true"}
        argv += ["--processes", str(processes)]
    name = "dispenser worker" if processes == 1 else f"dispenser serve --processes {processes}"
    log = workdir / ("worker.log" if processes == 1 else f"worker-{processes}.log")
    return Child(name, argv, log, env)


def cases(processes: int) -> tuple[Case, ...]:
    """The cases: :data:`CASES`, and with ``processes`` above 1 Leaf's forms on that many processes."""
    if processes == 1:
        return CASES
    many = f"dispenser-{processes}"
    return (
        *CASES,
        Case(f"segment, Leaf's form, {processes} processes", many, "segment", CASES[1].path, "ids", 1),
        Case(f"snowflake, Leaf's form, {processes} processes", many, "snowflake", CASES[2].path, "ids", 1),
    )


async def _wait_all_serving(child: Child, url: str, processes: int, timeout: float = 60.0) -> None:
    """Wait until ``processes`` different snowflake worker IDs answer on ``url`` (every process serves)."""
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while len(seen) < processes:
        if child.exited:
            raise BenchError(f"the {child.name} exited with status {child.stop()}:\n{child.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"only {len(seen)} of {processes} processes answered {url} within {timeout:g}s")
        connector = aiohttp.TCPConnector(force_close=True)  # a connection each: any process may take it
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as response:
                seen.add((int(await response.text()) >> 12) & 1023)
        await asyncio.sleep(0.02)  # paces the polling


def _echo(workdir: Path, port: int) -> Child:
    argv = [sys.executable, "-m", "dispenser_lab.bench.http_echo", "--port", str(port)]
    return Child("trivial aiohttp handler", argv, workdir / "echo.log")


async def run(options: Options, workdir: Path) -> tuple[list[CaseResult], list[Target]]:
    """Start everything, measure every case at every number of connections, stop what was started."""
    wrk = _wrk()
    script = workdir / "report.lua"
    script.write_text(_WRK_SCRIPT)
    with bench_servers(workdir, options.nats_url, options.postgres_dsn) as (nats_url, _nats_pid, dsn):
        assert dsn is not None
        await prepare_tags(dsn, _TAGS)
        ports = {"echo": free_port(), "dispenser": free_port()}
        children = {
            "echo": _echo(workdir, ports["echo"]),
            "dispenser": _worker(workdir, nats_url, dsn, ports["dispenser"]),
        }
        many = f"dispenser-{options.processes}"
        if options.processes > 1:
            ports[many] = free_port()
            children[many] = _worker(workdir, nats_url, dsn, ports[many], options.processes)
        try:
            for child in children.values():
                child.start()
            for name, child in children.items():
                await _wait_answering(child, f"http://127.0.0.1:{ports[name]}{CASES[1].path}")
            if options.processes > 1:
                url = f"http://127.0.0.1:{ports[many]}{CASES[2].path}"
                await _wait_all_serving(children[many], url, options.processes)
            return await _measure(options, wrk, script, ports, children)
        finally:
            for child in children.values():
                child.stop()
            await remove_tags(dsn, _TAGS)


async def _measure(
    options: Options, wrk: str, script: Path, ports: dict[str, int], children: dict[str, Child]
) -> tuple[list[CaseResult], list[Target]]:
    windows: dict[tuple[str, int], list[Window]] = {}

    def url(case: Case) -> str:
        return f"http://127.0.0.1:{ports[case.responder]}{case.path}"

    def pid(case: Case) -> int | None:
        proc = children[case.responder].proc
        return None if proc is None else proc.pid

    measured = cases(options.processes)
    for connections in options.connections:
        if options.warmup:
            for case in measured:
                await _run_wrk(wrk, script, url(case), connections, options.warmup, pid=None)
        for round_ in range(options.repeat):
            # Every other round backwards: no case always runs right after the echo (or before it).
            for case in measured if round_ % 2 == 0 else reversed(measured):
                if children[case.responder].exited:
                    child = children[case.responder]
                    raise BenchError(f"the {child.name} exited during the run:\n{child.tail()}")
                window = await _run_wrk(wrk, script, url(case), connections, options.duration, pid=pid(case))
                _say(
                    options,
                    f"  {case.name} @{connections} (round {round_ + 1}): {fmt_rate(window.rate)} req/s, "
                    f"p99 {fmt_ms(window.p99_ms)} ms, {window.errors} errors",
                )
                windows.setdefault((case.name, connections), []).append(window)
    results = []
    for connections in options.connections:
        echo_windows = windows[(CASES[0].name, connections)]
        for case in measured:
            rounds = windows[(case.name, connections)]
            # The median window, and the median of the ratios to the echo's window of the same round: each
            # round's pair ran seconds apart, so a load that comes and goes on the machine weighs on both.
            window = sorted(rounds, key=lambda w: w.rate)[len(rounds) // 2]
            paired = [
                mine.rate / echo.rate for mine, echo in zip(rounds, echo_windows, strict=True) if echo.rate
            ]
            cpu_share = None if window.cpu_s is None else round(window.cpu_s / window.seconds, 3)
            answered = window.requests - window.errors
            costs = [
                w.cpu_s / (w.requests - w.errors) * 1e6 for w in rounds if w.cpu_s and w.requests > w.errors
            ]
            results.append(
                CaseResult(
                    name=f"{case.name} @{connections}",
                    responder=case.responder,
                    kind="throughput",
                    mode=case.mode,
                    subject=case.path,
                    format=case.fmt,
                    count=case.count,
                    inflight=connections,
                    step=None,
                    duration_s=round(window.seconds, 3),
                    requests=answered,
                    errors=sum(w.errors for w in rounds),
                    timeouts=sum(w.timeouts for w in rounds),
                    requests_per_s=round(window.rate, 1),
                    ids_per_s=None if case.responder == "echo" else round(window.rate * case.count, 1),
                    p50_ms=window.p50_ms,
                    p99_ms=window.p99_ms,
                    p999_ms=window.p999_ms,
                    max_ms=window.max_ms,
                    repetitions=options.repeat,
                    cpu_responder=cpu_share,
                    responder_us_per_request=round(statistics.median(costs), 1) if costs else None,
                    ratio_to_echo=(
                        None
                        if case.responder == "echo" or not paired
                        else round(statistics.median(paired), 3)
                    ),
                )
            )
    return results, _targets(results)


def cost_ratio(case: CaseResult, results: Sequence[CaseResult]) -> float | None:
    """The echo's server CPU per request over this case's (same connections).

    The rate ratio the server would reach if the CPU were all it waited for: much steadier than requests/s
    on a machine shared with other work.
    """
    echo = next((c for c in results if c.responder == "echo" and c.inflight == case.inflight), None)
    if echo is None or case.responder == "echo":
        return None
    return ratio(echo.responder_us_per_request, case.responder_us_per_request)


def _targets(results: Sequence[CaseResult]) -> list[Target]:
    targets = []
    for case in results:
        if case.name == f"{CASES[1].name} @64":
            measured = case.ratio_to_echo
            targets.append(
                Target(
                    name="Leaf's segment form vs a trivial aiohttp handler @64",
                    measured=f"{fmt_ratio(measured, percent=True)} ({fmt_rate(case.requests_per_s)}/s)",
                    goal=f">= {RATE_TARGET:.0%}",
                    passed=measured is not None and measured >= RATE_TARGET and case.errors == 0,
                )
            )
            cost = cost_ratio(case, results)
            targets.append(
                Target(
                    name="the same, by server CPU per request (echo's over the dispenser's) @64",
                    measured=fmt_ratio(cost, percent=True),
                    goal=f">= {RATE_TARGET:.0%}",
                    passed=cost is not None and cost >= RATE_TARGET,
                )
            )
    return targets


def _scaling(results: Sequence[CaseResult]) -> list[str]:
    """N processes against one, per form and connections: requests/s, and server CPU per request."""
    lines = []
    for many in (case for case in results if case.name.split(" @")[0].endswith(" processes")):
        form = many.name.split(", ")[0]
        one = next(
            (
                c
                for c in results
                if c.responder == "dispenser"
                and c.mode == many.mode
                and c.count == 1
                and c.inflight == many.inflight
                and c.name.startswith(form)
            ),
            None,
        )
        if one is None:
            continue
        lines.append(
            f"{many.name}: {fmt_ratio(ratio(many.requests_per_s, one.requests_per_s))} x the requests/s of one "
            f"process, {fmt_ratio(ratio(many.responder_us_per_request, one.responder_us_per_request))} x its "
            "server CPU per request"
        )
    return ["", *lines] if lines else []


def render(results: Sequence[CaseResult], targets: Sequence[Target]) -> str:
    """The report: one row per case, then the targets."""
    rows = [
        [
            case.name,
            fmt_rate(case.requests_per_s),
            fmt_ratio(case.ratio_to_echo),
            fmt_ms(case.p50_ms),
            fmt_ms(case.p99_ms),
            fmt_ms(case.p999_ms),
            str(case.errors + case.timeouts),
            fmt_ratio(case.cpu_responder),
            fmt_us(case.responder_us_per_request),
            fmt_ratio(cost_ratio(case, results)),
        ]
        for case in results
    ]
    headers = ["case", "req/s", "vs echo", "p50 ms", "p99 ms", "p999 ms", "errors", "server CPU", "µs/req"]
    table = render_table([*headers, "by CPU"], rows)
    lines = [table, *_scaling(results), "", "targets:"]
    lines += [
        f"  {'PASS' if t.passed else 'MISS'} {t.name}: {t.measured} (goal {t.goal})" for t in targets
    ] or ["  (no case at 64 connections)"]
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="dispenser bench http",
        description="Leaf's HTTP API of a worker against a trivial aiohttp handler, measured with wrk.",
    )
    parser.add_argument(
        "--connections", default="64", help="connections kept open, e.g. 1,64 (default 64: the target's)"
    )
    parser.add_argument("--duration", type=int, default=5, help="measured seconds per window (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="seconds of warm-up per case (default 1; 0: none)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds: measured windows per case, medians reported (default 3)",
    )
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH", help="write the report here")
    parser.add_argument("--nats-url", help="use this NATS server (default: start one)")
    parser.add_argument("--postgres-dsn", help="use this PostgreSQL database (default: start a server)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="also measure `dispenser serve --processes N` in the same rounds (default 1: only one process)",
    )
    args = parser.parse_args(argv)
    try:
        connections = [int(part) for part in args.connections.split(",")]
    except ValueError:
        parser.error(f"--connections: not a list of numbers: {args.connections!r}")
    if any(c < 1 for c in connections) or args.duration < 1 or args.repeat < 1 or args.warmup < 0:
        parser.error("--connections, --duration and --repeat must be at least 1, --warmup at least 0")
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    return Options(
        connections=connections,
        duration=args.duration,
        warmup=args.warmup,
        repeat=args.repeat,
        json_path=args.json_path,
        nats_url=args.nats_url,
        postgres_dsn=args.postgres_dsn,
        quiet=args.quiet,
        strict=args.strict,
        processes=args.processes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``dispenser bench http``: run, print the table, write the JSON.

    Returns 1 on failure (or on a missed target with ``--strict``), else 0.
    """
    options = _parse(argv)
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="dispenser-bench-http-") as tmp:
            results, targets = run_async(run(options, Path(tmp)))
    except BenchError as exc:
        print(f"dispenser bench http: {exc}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()
    loads = (
        f"load average {[round(v, 2) for v in load_before]} before, {[round(v, 2) for v in load_after]} after"
    )
    print(f"dispenser bench http — {os.cpu_count()} CPUs, {options.duration} s windows, {loads}\n")
    print(render(results, targets))
    if options.json_path is not None:
        write_json(
            options.json_path,
            {
                "benchmark": "http",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "host": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                },
                "settings": {
                    "connections": options.connections,
                    "duration_s": options.duration,
                    "warmup_s": options.warmup,
                    "repeat": options.repeat,
                    "load_generator": "wrk -t1",
                    "processes": options.processes,
                },
                "load_average": {"before": list(load_before), "after": list(load_after)},
                "cases": [case.as_dict() for case in results],
                "targets": [target.as_dict() for target in targets],
            },
        )
    if options.strict and not all(t.passed for t in targets):
        return 1
    return 0
