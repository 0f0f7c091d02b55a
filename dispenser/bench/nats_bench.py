"""``dispenser bench nats``: the dispenser worker against a trivial echo responder, over one NATS server.

This module runs the servers, the responders and the cases (:func:`run`) and is the command
(:func:`main`). The parts: :mod:`~dispenser.bench.nats_plan` (options, bodies, mode plans),
:mod:`~dispenser.bench.nats_load` (responder processes, load generator, samples, reply checks),
:mod:`~dispenser.bench.nats_report` (targets, report, tables). What runs, the cases and the figures:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import platform
import secrets
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client

from dispenser.bench.deployment import Deployment, check_answers, deployment_tag
from dispenser.bench.nats_load import (
    Child,
    ReplyCheck,
    Sample,
    SwitchSplit,
    count_ids,
    drive,
    make_case,
    sampled_count_check,
    wait_ready,
)
from dispenser.bench.nats_plan import (
    STATE_DIR_IN_WORKDIR,
    THROUGHPUT_BODIES,
    BenchError,
    BenchOptions,
    Body,
    ModePlan,
    parse_options,
    plan_for_mode,
)
from dispenser.bench.nats_report import Report, evaluate_targets, profile_summary, render_report
from dispenser.bench.servers import bench_servers, prepare_tags, remove_tags
from dispenser.bench.stats import CaseResult, ratio, summarize, write_json
from dispenser.runner import run_async
from dispenser.tables import fmt_ms, fmt_rate

__all__ = ["BenchError", "BenchOptions", "main", "parse_options", "run"]


def _say(options: BenchOptions, text: str) -> None:
    if not options.quiet:
        print(text, file=sys.stderr, flush=True)


def _worker_argv(profile: Path | None, command: str | None) -> list[str]:
    if command is not None:
        return shlex.split(command)
    if profile is None:
        return [sys.executable, "-m", "dispenser", "serve"]
    # cProfile writes the file when the worker exits on our SIGTERM (run_worker returns, SystemExit).
    return [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "dispenser", "serve"]


# -- the measurement ---------------------------------------------------------------------------------


def _echo_child(options: BenchOptions, nats_url: str, workdir: Path) -> Child:
    """The echo responder (not started yet): ``<prefix>.echo.>``, and ``<prefix>.echo-sized.>`` sized."""
    prefix = options.subject_prefix
    return Child(
        "echo responder",
        [
            *(sys.executable, "-m", "dispenser.bench.echo"),
            *("--url", nats_url, "--subject", f"{prefix}.echo.>", "--queue", f"{prefix}-bench-echo"),
            *("--sized-subject", f"{prefix}.echo-sized.>"),
        ],
        workdir / "echo.log",
    )


def _worker_child(
    options: BenchOptions, nats_url: str, dsn: str | None, workdir: Path, plan: ModePlan
) -> Child:
    """The dispenser worker (not started yet), with the ``DISPENSER_*`` settings of ``plan``."""
    env = dict(os.environ)
    env |= {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": options.subject_prefix,
        "DISPENSER_LOG_LEVEL": "WARNING",
        "DISPENSER_LOG_FORMAT": "text",
    }
    if dsn is not None:
        env["DISPENSER_POSTGRES_DSN"] = dsn
    env |= {k: v.replace(STATE_DIR_IN_WORKDIR, str(workdir / "state")) for k, v in plan.worker_env.items()}
    return Child(
        "dispenser worker",
        _worker_argv(options.profile_worker, options.worker_command),
        workdir / "worker.log",
        env,
    )


@dataclass(slots=True)
class _Session:
    """The started responders and the connection every case is measured through."""

    options: BenchOptions
    plan: ModePlan
    nc: Client
    echo: Child
    worker: Child
    nats_pid: int | None

    @property
    def prefix(self) -> str:
        """The worker's subject prefix (``--subject-prefix``)."""
        return self.options.subject_prefix

    @property
    def steady_subject(self) -> str:
        """The dispenser's subject for the large-step tag."""
        return f"{self.prefix}.{self.plan.kind}.{self.plan.steady_tag}"

    @property
    def echo_subject(self) -> str:
        """The echo's subject for the same tag."""
        return f"{self.prefix}.echo.{self.plan.steady_tag}"

    async def window(
        self, subject: str, body: Body, inflight: int, check: ReplyCheck | None, *, request_id: bool = False
    ) -> Sample:
        """One measured window of ``body`` on ``subject``, watching the CPU of its responder, us and NATS.

        With ``request_id``, every request carries a fresh one (as a client of an at-least-once transport
        sends).
        """
        responder = self.echo if subject.startswith(f"{self.prefix}.echo") else self.worker
        if responder.exited:
            raise BenchError(f"the {responder.name} exited during the run:\n{responder.tail()}")
        watch = {"loadgen": os.getpid()}
        if responder.proc is not None:
            watch["responder"] = responder.proc.pid
        if self.nats_pid is not None:
            watch["nats"] = self.nats_pid
        return await drive(
            self.nc,
            subject,
            _with_request_ids(body) if request_id else body.encode(),
            inflight=inflight,
            warmup=self.options.warmup,
            duration=self.options.duration,
            timeout=self.options.timeout,
            check=check,
            watch=watch,
        )

    def record(
        self,
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
        """The case record of ``sample``, with its progress line on stderr."""
        case = make_case(
            name=name,
            responder=responder,
            kind=kind,
            mode=None if responder == "echo" else self.plan.mode,
            subject=subject,
            body=body,
            inflight=inflight,
            step=step,
            sample=sample,
            repetitions=self.options.repeat if windows is None else windows,
        )
        case.reply_bytes = reply
        _say(
            self.options,
            f"  {name:<38} {fmt_rate(case.requests_per_s):>9} req/s  p50 {fmt_ms(case.p50_ms):>6} ms  "
            f"p999 {fmt_ms(case.p999_ms):>7} ms  errors {case.errors + case.timeouts}",
        )
        return case


async def _measure(
    options: BenchOptions,
    nats_url: str,
    dsn: str | None,
    workdir: Path,
    plan: ModePlan,
    *,
    nats_pid: int | None,
) -> list[CaseResult]:
    """Start the responders, measure every case, and stop them again whatever happens."""
    echo = _echo_child(options, nats_url, workdir)
    worker = _worker_child(options, nats_url, dsn, workdir, plan)
    cases: list[CaseResult] = []
    nc: Client | None = None
    try:
        echo.start()
        worker.start()
        nc = await nats.connect(nats_url, name="dispenser-bench", allow_reconnect=False)
        session = _Session(options, plan, nc, echo, worker, nats_pid)
        await wait_ready(nc, echo, session.echo_subject, b"")
        await wait_ready(nc, worker, session.steady_subject, b"")
        reply_bytes = await _reply_sizes(session)
        for inflight in options.inflight:
            for body in THROUGHPUT_BODIES:
                cases += await _throughput_cases(session, body, inflight, reply_bytes[body])
        if options.request_id:
            for inflight in options.inflight:
                cases += await _request_id_cases(session, inflight)
        if plan.switch_tag is not None and plan.switch_step is not None:
            cases += await _switch_cases(session, plan.switch_tag, plan.switch_step)
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


async def _reply_sizes(session: _Session) -> dict[Body, int]:
    """Ask the worker once for each throughput body: is the reply right, and how many bytes is it?"""
    reply_bytes: dict[Body, int] = {}
    for body in THROUGHPUT_BODIES:
        msg = await session.nc.request(session.steady_subject, body.encode(), timeout=session.options.timeout)
        if msg.headers or count_ids(msg.data) != body.count:
            raise BenchError(f"the worker answered {body.label} with {msg.data[:300]!r}")
        reply_bytes[body] = len(msg.data)
    return reply_bytes


async def _throughput_cases(session: _Session, body: Body, inflight: int, size: int) -> list[CaseResult]:
    """The echo, the sized echo (if the reply is much larger than the body) and the dispenser on ``body``.

    Echo and dispenser run back to back (alternating with --repeat), so that both see the same machine
    load; of N windows each, the best by requests/s counts. A reply much larger than the request (100 IDs
    as JSON) also costs the client and the server: a second echo, answering with a canned body of the
    dispenser's reply size, separates that from the worker's own cost.
    """
    sized_subject = f"{session.prefix}.echo-sized.{size}" if size > len(body.encode()) + 256 else None
    echo_best, sized_best, best = await _best_windows(session, body, inflight, sized_subject)
    base = session.record(
        f"echo {body.label} @{inflight}",
        responder="echo",
        kind="throughput",
        subject=session.echo_subject,
        body=body,
        inflight=inflight,
        step=None,
        sample=echo_best,
        reply=len(body.encode()),
    )
    cases = [base]
    sized: CaseResult | None = None
    if sized_subject is not None and sized_best is not None:
        sized = session.record(
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
    case = session.record(
        f"{session.plan.mode} {body.label} @{inflight}",
        responder="dispenser",
        kind="throughput",
        subject=session.steady_subject,
        body=body,
        inflight=inflight,
        step=session.plan.steady_step,
        sample=best,
        reply=size,
    )
    case.ratio_to_echo = ratio(case.requests_per_s, base.requests_per_s)
    if sized is not None:
        case.ratio_to_sized_echo = ratio(case.requests_per_s, sized.requests_per_s)
    cases.append(case)
    return cases


def _with_request_ids(body: Body) -> Callable[[], bytes]:
    """Bodies like ``body``'s, each with a fresh ``request_id`` (a counter under a random run prefix)."""
    prefix = body.encode()[:-1] + b',"request_id":"' + secrets.token_hex(6).encode() + b"-"
    counter = itertools.count()

    def make() -> bytes:
        return prefix + str(next(counter)).encode() + b'"}'

    return make


async def _request_id_cases(session: _Session, inflight: int) -> list[CaseResult]:
    """``ids/1`` without and with a fresh ``request_id`` per request, alternating; the best window of each."""
    body = THROUGHPUT_BODIES[0]
    plain: Sample | None = None
    keyed: Sample | None = None
    for _ in range(session.options.repeat):
        plain = _better(plain, await session.window(session.steady_subject, body, inflight, None))
        check = sampled_count_check(body.count)
        keyed = _better(
            keyed, await session.window(session.steady_subject, body, inflight, check, request_id=True)
        )
    assert plain is not None
    assert keyed is not None
    base, case = (
        session.record(
            f"{session.plan.mode} {body.label} @{inflight}{suffix}",
            responder="dispenser",
            kind="request_id",
            subject=session.steady_subject,
            body=body,
            inflight=inflight,
            step=session.plan.steady_step,
            sample=sample,
        )
        for suffix, sample in ((" plain", plain), (" request_id", keyed))
    )
    return [base, case]


async def _best_windows(
    session: _Session, body: Body, inflight: int, sized_subject: str | None
) -> tuple[Sample, Sample | None, Sample]:
    """The best window (by requests/s) of the echo, the sized echo (if any) and the dispenser."""
    echo_best: Sample | None = None
    sized_best: Sample | None = None
    best: Sample | None = None
    for _ in range(session.options.repeat):
        echo_best = _better(echo_best, await session.window(session.echo_subject, body, inflight, None))
        if sized_subject is not None:
            sized_best = _better(sized_best, await session.window(sized_subject, body, inflight, None))
        check = sampled_count_check(body.count)
        best = _better(best, await session.window(session.steady_subject, body, inflight, check))
    assert echo_best is not None
    assert best is not None
    return echo_best, sized_best, best


async def _switch_cases(session: _Session, switch_tag: str, switch_step: int) -> list[CaseResult]:
    """At each concurrency, the small-step tag against the same body on the large-step tag."""
    body = Body("ids", session.options.switch_count)
    switch_subject = f"{session.prefix}.{session.plan.kind}.{switch_tag}"
    await wait_ready(session.nc, session.worker, switch_subject, body.encode())
    cases: list[CaseResult] = []
    for inflight in session.options.inflight:
        split = SwitchSplit(switch_step, body.count)
        reference, switching, windows = await _switch_windows(session, switch_subject, body, inflight, split)
        plan = session.plan
        ref_case = session.record(
            f"{plan.mode} {body.label} @{inflight} step {plan.steady_step:,}",
            responder="dispenser",
            kind="reference",
            subject=session.steady_subject,
            body=body,
            inflight=inflight,
            step=plan.steady_step,
            sample=reference,
        )
        case = session.record(
            f"{plan.mode} {body.label} @{inflight} step {switch_step:,}",
            responder="dispenser",
            kind="switch",
            subject=switch_subject,
            body=body,
            inflight=inflight,
            step=switch_step,
            sample=switching,
            windows=windows,
        )
        _add_switch_figures(case, split, ref_case)
        cases += [ref_case, case]
    return cases


async def _switch_windows(
    session: _Session, switch_subject: str, body: Body, inflight: int, split: SwitchSplit
) -> tuple[Sample, Sample, int]:
    """The reference and the switch-over samples, and how many windows the switch-over one pools.

    The same body on the large-step tag (what the run would be without switch-overs), then on the
    small-step tag; with --repeat, all windows of each are pooled.
    """
    options = session.options
    reference: Sample | None = None
    switching: Sample | None = None
    for _ in range(options.repeat):
        check = sampled_count_check(body.count)
        reference = _pooled(reference, await session.window(session.steady_subject, body, inflight, check))
        switching = _pooled(switching, await session.window(switch_subject, body, inflight, split.check))
    assert reference is not None
    assert switching is not None
    # A p999 needs about 1,000 samples to be more than the maximum: measure on until there are
    # --min-switches switch-overs (or --switch-max-time has passed).
    extra = 0
    while (
        len(split.switch_ns) < options.min_switches
        and switching.elapsed + options.duration <= options.switch_max_time
    ):
        switching = switching.merge(await session.window(switch_subject, body, inflight, split.check))
        extra += 1
    return reference, switching, options.repeat + extra


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


# -- the run -----------------------------------------------------------------------------------------


def run(options: BenchOptions) -> Report:
    """Run every case and return the report (also written to ``options.json_path`` if set).

    Raises:
        BenchError: a server or responder could not be started, or a responder went away.
    """
    from dispenser.testing.servers import DevServerError  # noqa: PLC0415

    deployment = _deployment_of(options)
    if deployment is not None:
        return _run_deployment(options, deployment)
    run_id = secrets.token_hex(3)
    plan = plan_for_mode(options, run_id)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dispenser-bench-") as tmp:
        workdir = Path(tmp)
        if os.geteuid() == 0:
            workdir.chmod(0o755)  # PostgreSQL runs as its own user below it
        try:
            with bench_servers(
                workdir, options.nats_url, options.postgres_dsn, need_postgres=bool(plan.tags)
            ) as (nats_url, nats_pid, dsn):
                _say(options, f"servers: NATS {nats_url}" + (f", PostgreSQL {dsn}" if dsn else ""))
                if dsn is not None and plan.tags:
                    run_async(prepare_tags(dsn, plan.tags))
                try:
                    cases = run_async(_measure(options, nats_url, dsn, workdir, plan, nats_pid=nats_pid))
                finally:
                    if dsn is not None and plan.tags:
                        run_async(remove_tags(dsn, plan.tags))
        except DevServerError as exc:
            raise BenchError(f"cannot start a server: {exc}") from exc
    servers = "external" if options.nats_url or options.postgres_dsn else "started by the bench"
    return _report(options, cases, _meta(options, started, load_before, servers))


def _meta(
    options: BenchOptions, started: datetime.datetime, load_before: tuple[float, float, float], servers: str
) -> dict[str, object]:
    """What the run was: the host, the load average around it, the settings."""
    return {
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
            "servers": servers,
            "profiled": options.profile_worker is not None,
            "worker_command": options.worker_command,
            "request_id": options.request_id,
        },
    }


def _report(options: BenchOptions, cases: list[CaseResult], meta: dict[str, object]) -> Report:
    report = Report(cases, evaluate_targets(cases), meta)
    if options.profile_worker is not None:
        report.profile = profile_summary(options.profile_worker)
    if options.json_path is not None:
        write_json(options.json_path, report.as_dict())
    return report


def _deployment_of(options: BenchOptions) -> Deployment | None:
    """The deployment ``--tag``/``--create-tag`` name (with ``--nats-url``), or ``None`` for a local run."""
    tag = options.tag or options.create_tag
    if tag is None:
        return None
    if options.nats_url is None:
        raise BenchError("--tag and --create-tag measure a deployment: give its --nats-url")
    return Deployment(options.nats_url, tag, options.postgres_dsn if options.create_tag else None)


def _run_deployment(options: BenchOptions, deployment: Deployment) -> Report:
    """The throughput cases against a deployment: no echo, no switch-over tag, nothing started here."""
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    with deployment_tag(deployment, options.step) as tag:
        _say(options, f"deployment: NATS {deployment.nats_url}, tag {tag}")
        cases = run_async(_measure_deployment(options, deployment.nats_url, tag))
    meta = _meta(options, started, load_before, "a deployment")
    meta["deployment"] = {"tag": tag, "created": deployment.create_dsn is not None}
    return _report(options, cases, meta)


async def _measure_deployment(options: BenchOptions, nats_url: str, tag: str) -> list[CaseResult]:
    """Each throughput body at each concurrency on ``<prefix>.segment.<tag>``, as a client of the deployment.

    There is no echo to compare with (the deployment's NATS is not ours to load with one), so the report
    holds the dispenser's figures and the targets that need no echo.
    """
    subject = f"{options.subject_prefix}.segment.{tag}"
    nc = await nats.connect(nats_url, name="dispenser-bench", allow_reconnect=False)
    cases: list[CaseResult] = []
    try:
        for inflight in options.inflight:
            for body in THROUGHPUT_BODIES:
                reply = await check_answers(nc, subject, body.encode(), options.timeout)
                if count_ids(reply) != body.count:
                    raise BenchError(f"the deployment answered {body.label} with {reply[:300]!r}")
                best: Sample | None = None
                for _ in range(options.repeat):
                    window = await drive(
                        nc,
                        subject,
                        body.encode(),
                        inflight=inflight,
                        warmup=options.warmup,
                        duration=options.duration,
                        timeout=options.timeout,
                        check=sampled_count_check(body.count),
                        watch={"loadgen": os.getpid()},
                    )
                    best = _better(best, window)
                assert best is not None
                case = make_case(
                    name=f"deployment {body.label} @{inflight}",
                    responder="dispenser",
                    kind="throughput",
                    mode="segment",
                    subject=subject,
                    body=body,
                    inflight=inflight,
                    step=None,
                    sample=best,
                    repetitions=options.repeat,
                )
                case.reply_bytes = len(reply)
                _say(
                    options,
                    f"  {case.name:<38} {fmt_rate(case.requests_per_s):>9} req/s  p50 {fmt_ms(case.p50_ms):>6} ms  "
                    f"p999 {fmt_ms(case.p999_ms):>7} ms  errors {case.errors + case.timeouts}",
                )
                cases.append(case)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return cases


# -- the command -------------------------------------------------------------------------------------


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
