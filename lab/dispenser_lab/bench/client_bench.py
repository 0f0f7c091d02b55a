"""``dispenser bench client``: the buffered client against a request per ID, in one process.

Local (servers and a worker started here) or against a deployment (:mod:`dispenser_lab.bench.deployment`).
Locally it also measures ``next_id`` on a permuted tag beside the plain one (docs/permuted.md). The cases,
how calls are timed and the figures: ``docs/benchmarks.md`` ("The buffered client", "Permuted tags").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client

from dispenser.client import BlockingIdClient, BufferSettings, IdClient
from dispenser.runner import run_async
from dispenser.tables import fmt_rate, fmt_us, render_table
from dispenser_lab.bench.deployment import (
    Deployment,
    add_target_options,
    check_answers,
    deployment_of,
    deployment_tag,
)
from dispenser_lab.bench.nats_load import Child, serving_worker, wait_ready
from dispenser_lab.bench.nats_plan import BenchError
from dispenser_lab.bench.servers import (
    bench_servers,
    prepare_permuted_tag,
    prepare_tags,
    remove_tags,
    write_bench_key,
)
from dispenser_lab.bench.stats import host_meta, percentile, write_json

__all__ = ["CaseResult", "Target", "main", "run"]

_YIELD_EVERY = 1000
_AWAIT_ROUNDS = 9
"""Rounds of next_id against a bare await (the median round is reported)."""
_PERMUTED_ROUNDS = 5
"""Rounds of next_id from the buffer, the plain tag's against the permuted tag's (the median is reported)."""
_HELD_WAIT = 10.0
"""Seconds a from-the-buffer round waits for a tag's buffer to hold its calls (it times what is held after)."""
_STEP = 100_000


@dataclass(slots=True)
class CaseResult:
    """One measured case."""

    name: str
    calls: int
    ids: int
    seconds: float
    p50_us: float
    p99_us: float
    p999_us: float
    max_us: float
    worker_requests: int | None
    """Requests the worker answered during the case (its ``$SRV.STATS``); ``None`` against a deployment."""

    @property
    def calls_per_s(self) -> float:
        """Calls per second."""
        return self.calls / self.seconds

    @property
    def ids_per_s(self) -> float:
        """IDs per second."""
        return self.ids / self.seconds

    @property
    def requests_per_million(self) -> float | None:
        """Requests reaching the worker per million IDs (``None``: not counted, against a deployment)."""
        if self.worker_requests is None:
            return None
        return self.worker_requests * 1_000_000 / max(1, self.ids)

    def as_dict(self) -> dict[str, object]:
        """The JSON record."""
        return asdict(self) | {
            "calls_per_s": self.calls_per_s,
            "ids_per_s": self.ids_per_s,
            "requests_per_million_ids": self.requests_per_million,
        }


@dataclass(frozen=True, slots=True)
class Target:
    """A goal of issue 13 and whether this run met it."""

    name: str
    measured: str
    passed: bool


@dataclass(frozen=True, slots=True)
class AwaitRatio:
    """``await client.next_id(tag)`` against the least an awaited call can cost, in alternating rounds.

    The bare await is ``await bare()`` of a coroutine that returns the next value of a counter: what a
    ``next_id`` that did nothing but count would cost. No call is timed on its own (a clock read per call
    would cost as much as the call): each round times 1,000-call blocks, yielding to the loop between them
    (untimed), ``calls`` of each per round.
    """

    rounds: int
    calls: int
    bare_calls_per_s: float
    """The median round's rate of the bare await."""
    next_id_calls_per_s: float
    """The median round's rate of ``next_id``."""
    ratio: float
    """The median over the rounds of ``next_id``'s rate over the bare await's in the same round."""


@dataclass(frozen=True, slots=True)
class PermutedRatio:
    """``next_id`` on a permuted tag against the plain tag, one client, from IDs already in hand.

    Each round waits until both tags' buffers hold ``calls`` IDs, then times ``calls`` calls of each in a
    row without yielding (no refill runs meanwhile: what the calls cost, not what the workers supply).
    """

    rounds: int
    calls: int
    plain_calls_per_s: float
    """The median round's rate of the plain tag."""
    permuted_calls_per_s: float
    """The median round's rate of the permuted tag."""
    ratio: float
    """The median over the rounds of the permuted tag's rate over the plain tag's in the same round."""


@dataclass(slots=True)
class Report:
    """Cases, targets and what the run was."""

    cases: list[CaseResult]
    targets: list[Target]
    meta: dict[str, object] = field(default_factory=dict)
    await_ratio: AwaitRatio | None = None
    permuted: PermutedRatio | None = None


def _percentile_us(sorted_ns: Sequence[int], q: float) -> float:
    return percentile(sorted_ns, q) / 1000 if sorted_ns else 0.0


class _Timer:
    """Latencies of single calls, and the count of IDs they returned."""

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.ids = 0
        self.started = 0.0
        self.seconds = 0.0

    def result(self, name: str, worker_requests: int | None) -> CaseResult:
        ns = sorted(self.ns)
        return CaseResult(
            name=name,
            calls=len(ns),
            ids=self.ids,
            seconds=self.seconds,
            p50_us=_percentile_us(ns, 0.5),
            p99_us=_percentile_us(ns, 0.99),
            p999_us=_percentile_us(ns, 0.999),
            max_us=ns[-1] / 1000 if ns else 0.0,
            worker_requests=worker_requests,
        )


async def _worker_requests(nc: Client) -> int:
    """The requests the (single) worker has answered so far, from its ``$SRV.STATS``."""
    msg = await nc.request("$SRV.STATS.leaf-dispenser", b"", timeout=5.0)
    stats = json.loads(msg.data)
    return sum(int(e["num_requests"]) for e in stats["endpoints"])


async def _loop(call: Callable[[], Awaitable[int]], duration: float, timer: _Timer) -> None:
    """Call ``call`` for ``duration`` seconds, timing each call; yield every 1,000 calls, untimed."""
    clock = time.perf_counter_ns
    ns = timer.ns
    end = time.perf_counter() + duration
    timer.started = time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(_YIELD_EVERY):
            start = clock()
            got = await call()
            ns.append(clock() - start)
            timer.ids += got
        await asyncio.sleep(0)
    timer.seconds = time.perf_counter() - timer.started


async def _request_case(nc: Client, subject: str, inflight: int, duration: float) -> _Timer:
    timer = _Timer()
    clock = time.perf_counter_ns
    end = time.perf_counter() + duration

    async def requester() -> None:
        while time.perf_counter() < end:
            start = clock()
            await nc.request(subject, b"", timeout=5.0)
            timer.ns.append(clock() - start)
            timer.ids += 1

    timer.started = time.perf_counter()
    await asyncio.gather(*(requester() for _ in range(inflight)))
    timer.seconds = time.perf_counter() - timer.started
    return timer


def _blocking_case(client: BlockingIdClient, tag: str, threads: int, duration: float) -> _Timer:
    timer = _Timer()
    lock = threading.Lock()
    end = time.perf_counter() + duration

    def work() -> None:
        clock = time.perf_counter_ns
        ns: list[int] = []
        while time.perf_counter() < end:
            for _ in range(_YIELD_EVERY):
                start = clock()
                client.next_id(tag)
                ns.append(clock() - start)
        with lock:
            timer.ns += ns
            timer.ids += len(ns)

    workers = [threading.Thread(target=work, name=f"bench-{n}") for n in range(threads)]
    timer.started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    timer.seconds = time.perf_counter() - timer.started
    return timer


def _per_million(result: CaseResult) -> str:
    per_million = result.requests_per_million
    return "not counted" if per_million is None else f"{per_million:,.1f}"


async def _measure(
    nats_url: str,
    tag: str,
    child: Child | None,
    duration: float,
    warmup: float,
    *,
    say: Callable[[str], None],
    timeout: float = 5.0,
    permuted_tag: str | None = None,
) -> tuple[list[CaseResult], AwaitRatio, PermutedRatio | None]:
    """Every case on ``tag``, and next_id against a bare await; ``child``: the worker started here, or ``None``.

    With ``permuted_tag``, next_id on it too: timed call by call, then from the buffer against ``tag``'s.
    """
    subject = f"leaf.segment.{tag}"
    nc = await nats.connect(nats_url, name="dispenser-bench-client", allow_reconnect=False)
    cases: list[CaseResult] = []
    try:
        if child is None:
            await check_answers(nc, subject, b"", timeout)
        else:
            await wait_ready(nc, child, subject, b"")

        async def case(name: str, run: Callable[[], Awaitable[_Timer]]) -> None:
            # Only the worker started here is ours alone: a deployment's count holds other clients' requests.
            before = None if child is None else await _worker_requests(nc)
            timer = await run()
            after = None if child is None else await _worker_requests(nc)
            result = timer.result(name, None if after is None or before is None else after - before)
            say(
                f"  {name:<32} {fmt_rate(result.ids_per_s):>12} IDs/s  p50 {fmt_us(result.p50_us):>7} µs  "
                f"p99 {fmt_us(result.p99_us):>7} µs  {_per_million(result)} requests per 1M IDs"
            )
            cases.append(result)

        for inflight in (1, 64):
            await _request_case(nc, subject, inflight, warmup)
            await case(
                f"nc.request per ID @{inflight}",
                functools.partial(_request_case, nc, subject, inflight, duration),
            )

        settings = BufferSettings()
        async with IdClient.over_nats(nats_url, settings) as client:

            async def next_id() -> int:
                await client.next_id(tag)
                return 1

            async def take() -> int:
                return len(await client.take(tag, 1000))

            await _loop(next_id, warmup, _Timer())
            await case("IdClient.next_id", functools.partial(_timed, next_id, duration))
            await _loop(take, warmup, _Timer())
            await case("IdClient.take(1000)", functools.partial(_timed, take, duration))
            ratio = await _await_ratio(client, tag, _AWAIT_ROUNDS, max(_YIELD_EVERY, int(duration * 200_000)))
            say(
                f"  next_id {fmt_rate(ratio.next_id_calls_per_s)} calls/s against a bare await's "
                f"{fmt_rate(ratio.bare_calls_per_s)}: {ratio.ratio:.2f}"
            )
            permuted = None
            if permuted_tag is not None:
                name = permuted_tag

                async def permuted_next_id() -> int:
                    await client.next_id(name)
                    return 1

                await _loop(permuted_next_id, warmup, _Timer())
                await case(
                    "IdClient.next_id, permuted tag", functools.partial(_timed, permuted_next_id, duration)
                )
                calls = max(_YIELD_EVERY, int(duration * 20_000))
                permuted = await _from_buffer(client, tag, permuted_tag, _PERMUTED_ROUNDS, calls)
                say(
                    f"  next_id from the buffer: permuted {fmt_rate(permuted.permuted_calls_per_s)} calls/s "
                    f"against plain {fmt_rate(permuted.plain_calls_per_s)}: {permuted.ratio:.2f}"
                )

        blocking = BlockingIdClient.over_nats(nats_url, settings)
        await asyncio.to_thread(blocking.start)
        try:
            for threads in (1, 4):
                await asyncio.to_thread(_blocking_case, blocking, tag, threads, warmup)
                await case(
                    f"BlockingIdClient.next_id x{threads} threads",
                    functools.partial(asyncio.to_thread, _blocking_case, blocking, tag, threads, duration),
                )
        finally:
            await asyncio.to_thread(blocking.close)
    finally:
        await nc.close()
    return cases, ratio, permuted


async def _held(client: IdClient, tag: str, calls: int) -> int:
    """IDs of ``tag`` in hand once the buffer holds ``calls`` (or after :data:`_HELD_WAIT` seconds)."""
    deadline = time.monotonic() + _HELD_WAIT
    while True:
        stats = client.stats(tag)
        held = 0 if stats is None else stats.ids_held
        if held >= calls or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.01)  # the refills run meanwhile


async def _from_buffer(client: IdClient, plain: str, permuted: str, rounds: int, calls: int) -> PermutedRatio:
    """``next_id`` of ``permuted`` against ``plain`` from the IDs in hand, ``rounds`` rounds in alternating order."""
    next_id = client.next_id

    async def run(tag: str, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):  # never suspends while IDs are held: no refill runs in the timing
            await next_id(tag)
        return time.perf_counter() - start

    pairs: list[tuple[float, float]] = []
    timed = calls
    for n in range(rounds):
        timed = max(1, min(calls, await _held(client, plain, calls), await _held(client, permuted, calls)))
        if n % 2:
            permuted_seconds, plain_seconds = await run(permuted, timed), await run(plain, timed)
        else:
            plain_seconds, permuted_seconds = await run(plain, timed), await run(permuted, timed)
        pairs.append((timed / plain_seconds, timed / permuted_seconds))
    pairs.sort(key=lambda pair: pair[1] / pair[0])
    plain_rate, permuted_rate = pairs[len(pairs) // 2]
    return PermutedRatio(rounds, timed, plain_rate, permuted_rate, permuted_rate / plain_rate)


async def _blocks(calls: int, block: Callable[[], Awaitable[None]]) -> float:
    """Seconds spent in ``calls // 1000`` awaits of ``block`` (1,000 calls each), yielding between them untimed."""
    clock = time.perf_counter
    spent = 0.0
    for _ in range(calls // _YIELD_EVERY):
        start = clock()
        await block()
        spent += clock() - start
        await asyncio.sleep(0)  # the client's refill runs here, as in a service that awaits its own I/O
    return spent


async def _await_ratio(client: IdClient, tag: str, rounds: int, calls: int) -> AwaitRatio:
    """``next_id`` against a bare await, ``rounds`` rounds in alternating order after one unmeasured."""
    counter = 0

    async def bare() -> int:
        nonlocal counter
        counter += 1
        return counter

    async def bare_block() -> None:
        for _ in range(_YIELD_EVERY):
            await bare()

    next_id = client.next_id

    async def next_id_block() -> None:
        for _ in range(_YIELD_EVERY):
            await next_id(tag)

    await _blocks(calls, bare_block)
    await _blocks(calls, next_id_block)
    pairs: list[tuple[float, float]] = []
    for n in range(rounds):
        if n % 2:
            id_seconds, bare_seconds = await _blocks(calls, next_id_block), await _blocks(calls, bare_block)
        else:
            bare_seconds, id_seconds = await _blocks(calls, bare_block), await _blocks(calls, next_id_block)
        pairs.append((bare_seconds, id_seconds))
    pairs.sort(key=lambda pair: pair[0] / pair[1])
    bare_seconds, id_seconds = pairs[len(pairs) // 2]
    return AwaitRatio(rounds, calls, calls / bare_seconds, calls / id_seconds, bare_seconds / id_seconds)


async def _timed(call: Callable[[], Awaitable[int]], duration: float) -> _Timer:
    timer = _Timer()
    await _loop(call, duration, timer)
    return timer


def _targets(cases: Sequence[CaseResult], ratio: AwaitRatio, permuted: PermutedRatio | None) -> list[Target]:
    by_name = {c.name: c for c in cases}
    best_request = max(by_name["nc.request per ID @1"].ids_per_s, by_name["nc.request per ID @64"].ids_per_s)
    next_id = by_name["IdClient.next_id"]
    take = by_name["IdClient.take(1000)"]
    return [
        Target(
            "next_id >= 500,000 calls/s",
            f"{next_id.calls_per_s:,.0f} calls/s",
            next_id.calls_per_s >= 500_000,
        ),
        Target("next_id p99 < 10 µs", f"{next_id.p99_us:.2f} µs", next_id.p99_us < 10),
        Target(
            "next_id >= 15x a request per ID",
            f"{next_id.ids_per_s / best_request:,.0f}x (vs {best_request:,.0f} requests/s)",
            next_id.ids_per_s >= 15 * best_request,
        ),
        Target(
            "take(1000) >= 10,000,000 IDs/s", f"{take.ids_per_s:,.0f} IDs/s", take.ids_per_s >= 10_000_000
        ),
        Target(
            "next_id >= 0.75 of a bare await",
            f"{ratio.ratio:.2f} ({ratio.next_id_calls_per_s:,.0f} against {ratio.bare_calls_per_s:,.0f} calls/s, "
            f"median of {ratio.rounds} rounds)",
            ratio.ratio >= 0.75,
        ),
        *(
            []
            if permuted is None
            else [
                Target(
                    "permuted next_id >= 0.5 of plain, from the buffer",
                    f"{permuted.ratio:.2f} ({permuted.permuted_calls_per_s:,.0f} against "
                    f"{permuted.plain_calls_per_s:,.0f} calls/s, median of {permuted.rounds} rounds)",
                    permuted.ratio >= 0.5,
                )
            ]
        ),
    ]


def _ratio_lines(ratio: AwaitRatio | None, permuted: PermutedRatio | None) -> list[str]:
    lines = []
    if ratio is not None:
        lines += [
            f"next_id against a bare await (untimed calls, {ratio.rounds} rounds of {ratio.calls:,} each, "
            f"median): {fmt_rate(ratio.next_id_calls_per_s)} against {fmt_rate(ratio.bare_calls_per_s)} "
            f"calls/s, {ratio.ratio:.2f}",
            "",
        ]
    if permuted is not None:
        lines += [
            f"next_id from the buffer, permuted tag against plain (untimed calls, {permuted.rounds} rounds "
            f"of {permuted.calls:,} each, median): {fmt_rate(permuted.permuted_calls_per_s)} against "
            f"{fmt_rate(permuted.plain_calls_per_s)} calls/s, {permuted.ratio:.2f}",
            "",
        ]
    return lines


def render(report: Report) -> str:
    """The table and the targets, as printed."""
    meta = report.meta
    lines = [
        f"dispenser bench client — {meta.get('date')} — {meta.get('cpus')} CPUs, Python {meta.get('python')}, "
        f"{meta.get('duration')} s per case (+{meta.get('warmup')} s warm-up), "
        f"load average {meta.get('loadavg_before')} before, {meta.get('loadavg_after')} after",
        "",
        render_table(
            ["case", "calls/s", "IDs/s", "p50 µs", "p99 µs", "p999 µs", "max µs", "requests per 1M IDs"],
            [
                [
                    c.name,
                    fmt_rate(c.calls_per_s),
                    fmt_rate(c.ids_per_s),
                    fmt_us(c.p50_us),
                    fmt_us(c.p99_us),
                    fmt_us(c.p999_us),
                    fmt_us(c.max_us),
                    _per_million(c),
                ]
                for c in report.cases
            ],
        ),
        "",
        *_ratio_lines(report.await_ratio, report.permuted),
        "targets:",
        *(f"  [{'ok' if t.passed else 'MISSED'}] {t.name}: {t.measured}" for t in report.targets),
    ]
    return "\n".join(lines) + "\n"


def run(
    duration: float = 3.0,
    warmup: float = 1.0,
    nats_url: str | None = None,
    postgres_dsn: str | None = None,
    quiet: bool = False,
    *,
    deployment: Deployment | None = None,
) -> Report:
    """Start the servers and the worker (unless given), measure every case, stop what was started.

    With ``deployment``, start nothing: measure the deployment on its tag (created and removed if asked).

    Raises:
        BenchError: a server or the worker could not be started, the worker went away, or the deployment
            does not answer on the tag.
    """
    from dispenser_lab.servers import DevServerError  # noqa: PLC0415

    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    tag = f"bench-client-{secrets.token_hex(3)}"
    permuted_tag = f"{tag}-permuted"
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    if deployment is not None:
        with deployment_tag(deployment, 100_000) as tag:
            say(f"deployment: NATS {deployment.nats_url}, tag {tag}")
            cases, ratio, _ = run_async(_measure(deployment.nats_url, tag, None, duration, warmup, say=say))
        meta = _meta(started, load_before, duration, warmup)
        meta["deployment"] = {"tag": tag, "created": deployment.create_dsn is not None}
        return Report(cases, _targets(cases, ratio, None), meta, ratio)
    with tempfile.TemporaryDirectory(prefix="dispenser-bench-client-") as tmp:
        workdir = Path(tmp)
        if os.geteuid() == 0:
            workdir.chmod(0o755)  # PostgreSQL runs as its own user below it
        try:
            with bench_servers(workdir, nats_url, postgres_dsn) as (url, _pid, dsn):
                if dsn is None:  # not reachable: need_postgres is the default
                    raise BenchError("no PostgreSQL to run against")
                say(f"servers: NATS {url}, PostgreSQL {dsn}")
                keys = workdir / "keys"  # the permuted tag's key: a fresh random one
                write_bench_key(keys, permuted_tag)
                run_async(prepare_tags(dsn, []))  # migrated, for the permuted tag
                run_async(prepare_permuted_tag(dsn, permuted_tag, _STEP))
                settings = {"DISPENSER_SEGMENT_PERMUTE_KEYS_DIR": str(keys)}
                try:
                    with serving_worker(
                        url, dsn, workdir, [(tag, _STEP, 1)], say, settings=settings
                    ) as child:
                        cases, ratio, permuted = run_async(
                            _measure(url, tag, child, duration, warmup, say=say, permuted_tag=permuted_tag)
                        )
                finally:
                    run_async(remove_tags(dsn, [(permuted_tag, _STEP, 1)]))
        except DevServerError as exc:
            raise BenchError(f"cannot start a server: {exc}") from exc
    meta = _meta(started, load_before, duration, warmup)
    return Report(cases, _targets(cases, ratio, permuted), meta, ratio, permuted)


def _meta(
    started: datetime.datetime, load_before: tuple[float, float, float], duration: float, warmup: float
) -> dict[str, object]:
    return {
        **host_meta(started, load_before),
        "duration": duration,
        "warmup": warmup,
        "buffer": asdict(BufferSettings()),
    }


def main(argv: Sequence[str]) -> int:
    """``dispenser bench client [OPTIONS]``: locally (``--local``) or a deployment (``--nats-url``, ``--tag``)."""
    parser = argparse.ArgumentParser(prog="dispenser bench client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per case (default 3)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per case (default 1)")
    parser.add_argument(
        "--nats-url",
        help="use this NATS server instead of starting one (with --tag: the deployment to measure)",
    )
    parser.add_argument(
        "--postgres-dsn", help="use this PostgreSQL instead of starting one (a tag is added, then removed)"
    )
    add_target_options(parser)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(list(argv))
    deployment = deployment_of(parser, args)
    try:
        report = run(
            args.duration, args.warmup, args.nats_url, args.postgres_dsn, args.quiet, deployment=deployment
        )
    except BenchError as exc:
        print(f"dispenser bench: {exc}", file=sys.stderr)
        return 1
    print(render(report), end="")
    if args.json is not None:
        write_json(
            args.json,
            {
                "meta": report.meta,
                "cases": [c.as_dict() for c in report.cases],
                "targets": [asdict(t) for t in report.targets],
                "next_id_vs_await": None if report.await_ratio is None else asdict(report.await_ratio),
                "permuted_vs_plain": None if report.permuted is None else asdict(report.permuted),
            },
        )
        print(f"\nwrote {args.json}")
    return 1 if args.strict and not all(t.passed for t in report.targets) else 0
