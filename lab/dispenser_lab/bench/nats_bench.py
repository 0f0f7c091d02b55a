"""``dispenser bench nats``: the dispenser worker against a trivial echo responder, over one NATS server.

This module runs the servers, the responders and the cases (:func:`run`) and is the command
(:func:`main`). The parts: :mod:`~dispenser_lab.bench.nats_plan` (options, bodies, mode plans),
:mod:`~dispenser_lab.bench.nats_load` (responder processes, load generator, samples, reply checks),
:mod:`~dispenser_lab.bench.nats_cases` (the cases measured through the responders),
:mod:`~dispenser_lab.bench.nats_report` (targets, report, tables). What runs, the cases and the figures:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import secrets
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nats
from nats.aio.client import Client

from dispenser.runner import run_async
from dispenser_lab.bench.deployment import Deployment, check_answers, deployment_tag
from dispenser_lab.bench.nats_cases import (
    Session,
    better,
    daily_cases,
    permuted_cases,
    reply_sizes,
    request_id_cases,
    say,
    say_case,
    switch_cases,
    throughput_cases,
    with_request_ids,
)
from dispenser_lab.bench.nats_load import (
    Child,
    Sample,
    count_ids,
    drive,
    make_case,
    sampled_count_check,
    wait_ready,
)
from dispenser_lab.bench.nats_plan import (
    DAILY_WIDTH,
    STATE_DIR_IN_WORKDIR,
    THROUGHPUT_BODIES,
    BenchError,
    BenchOptions,
    ModePlan,
    parse_options,
    plan_for_mode,
)
from dispenser_lab.bench.nats_processes import processes_cases
from dispenser_lab.bench.nats_report import Report, evaluate_targets, profile_summary, render_report
from dispenser_lab.bench.servers import (
    bench_servers,
    prepare_daily_tag,
    prepare_permuted_tag,
    prepare_tags,
    remove_tags,
    write_bench_key,
)
from dispenser_lab.bench.stats import CaseResult, write_json

__all__ = ["BenchError", "BenchOptions", "main", "parse_options", "run"]

_with_request_ids = with_request_ids
"""Moved to :mod:`~dispenser_lab.bench.nats_cases`; still importable from here under its old name."""


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
            *(sys.executable, "-m", "dispenser_lab.bench.echo"),
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
    if plan.permuted_tag is not None:
        env["DISPENSER_SEGMENT_PERMUTE_KEYS_DIR"] = str(workdir / "keys")
    env |= {k: v.replace(STATE_DIR_IN_WORKDIR, str(workdir / "state")) for k, v in plan.worker_env.items()}
    return Child(
        "dispenser worker",
        _worker_argv(options.profile_worker, options.worker_command),
        workdir / "worker.log",
        env,
    )


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
        session = Session(options, plan, nc, echo, worker, nats_pid)
        await wait_ready(nc, echo, session.echo_subject, b"")
        await wait_ready(nc, worker, session.steady_subject, b"")
        reply_bytes = await reply_sizes(session)
        for inflight in options.inflight:
            for body in THROUGHPUT_BODIES:
                cases += await throughput_cases(session, body, inflight, reply_bytes[body])
        if options.request_id:
            for inflight in options.inflight:
                cases += await request_id_cases(session, inflight)
        cases += await _policy_cases(session, options, plan)
        if plan.switch_tag is not None and plan.switch_step is not None:
            cases += await switch_cases(session, plan.switch_tag, plan.switch_step)
        if options.processes > 1:
            cases += await processes_cases(session, nats_url, dsn, workdir, options.processes)
        if worker.exited:
            raise BenchError(f"the worker exited during the run:\n{worker.tail()}")
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        worker_status = worker.stop()
        echo.stop()
        if worker_status not in (None, 0):
            say(options, f"dispenser worker exited with status {worker_status}:\n{worker.tail()}")
    return cases


async def _policy_cases(session: Session, options: BenchOptions, plan: ModePlan) -> list[CaseResult]:
    """The daily and permuted tags' cases (``--daily``, ``--permuted``), each beside the plain tag."""
    cases: list[CaseResult] = []
    for inflight in options.inflight:
        if plan.daily_tag is not None:
            cases += await daily_cases(session, inflight)
        if plan.permuted_tag is not None:
            cases += await permuted_cases(session, inflight)
    return cases


# -- the run -----------------------------------------------------------------------------------------


def run(options: BenchOptions) -> Report:
    """Run every case and return the report (also written to ``options.json_path`` if set).

    Raises:
        BenchError: a server or responder could not be started, or a responder went away.
    """
    from dispenser_lab.servers import DevServerError  # noqa: PLC0415

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
                say(options, f"servers: NATS {nats_url}" + (f", PostgreSQL {dsn}" if dsn else ""))
                tags = list(plan.tags)
                if dsn is not None and plan.tags:
                    run_async(prepare_tags(dsn, plan.tags))
                if dsn is not None and plan.daily_tag is not None and plan.steady_step is not None:
                    run_async(prepare_daily_tag(dsn, plan.daily_tag, plan.steady_step, DAILY_WIDTH))
                    tags.append((plan.daily_tag, plan.steady_step, 1))
                if dsn is not None and plan.permuted_tag is not None and plan.steady_step is not None:
                    write_bench_key(workdir / "keys", plan.permuted_tag)
                    run_async(prepare_permuted_tag(dsn, plan.permuted_tag, plan.steady_step))
                    tags.append((plan.permuted_tag, plan.steady_step, 1))
                try:
                    cases = run_async(_measure(options, nats_url, dsn, workdir, plan, nats_pid=nats_pid))
                finally:
                    if dsn is not None and tags:
                        run_async(remove_tags(dsn, tags))
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
            "daily": options.daily,
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
        say(options, f"deployment: NATS {deployment.nats_url}, tag {tag}")
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
                    best = better(best, window)
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
                say_case(options, case)
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
