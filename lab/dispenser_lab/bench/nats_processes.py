"""``dispenser bench nats --processes N``: one worker against ``dispenser serve --processes N``, in one run.

The second worker serves a subject prefix and a service name of its own (``<prefix>-p<N>``), so the two
never share a request; both take the same bodies in alternating windows, and the second's server CPU is the
sum of its processes' (supervisor, fork server and workers). Figures: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import replace
from pathlib import Path

import nats.errors

from dispenser_lab.bench.nats_cases import Session, better
from dispenser_lab.bench.nats_load import Child, Sample, drive, make_case, sampled_count_check, wait_ready
from dispenser_lab.bench.nats_plan import STATE_DIR_IN_WORKDIR, THROUGHPUT_BODIES, BenchError, Body
from dispenser_lab.bench.stats import CaseResult

__all__ = ["process_tree", "processes_cases"]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it, from ``/proc`` (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree += children
        frontier += children
    return tree


def _many_child(session: Session, nats_url: str, dsn: str | None, workdir: Path, processes: int) -> Child:
    env = dict(os.environ)
    env |= {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": f"{session.prefix}-p{processes}",
        "DISPENSER_NATS_SERVICE_NAME": f"bench-p{processes}",
        "DISPENSER_LOG_LEVEL": "WARNING",
        "DISPENSER_LOG_FORMAT": "text",
        # Static worker IDs 1 … N beside the single worker's 0 (the peer check refuses a shared one).
        "DISPENSER_SNOWFLAKE_WORKER_ID": "1",
        "DISPENSER_SNOWFLAKE_PER_PROCESS_WORKER_IDS": "true",
    }
    if dsn is not None:
        env["DISPENSER_POSTGRES_DSN"] = dsn
    state = str(workdir / f"state-p{processes}")
    env |= {k: v.replace(STATE_DIR_IN_WORKDIR, state) for k, v in session.plan.worker_env.items()}
    argv = [sys.executable, "-m", "dispenser", "serve", "--processes", str(processes)]
    return Child(f"dispenser serve --processes {processes}", argv, workdir / f"worker-p{processes}.log", env)


async def _all_serving(session: Session, child: Child, processes: int, timeout: float = 60.0) -> None:
    """Until ``processes`` instances of the second worker's service answer ``$SRV.PING``."""
    nc = session.nc
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if child.exited:
            raise BenchError(f"the {child.name} exited:\n{child.tail()}")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$SRV.PING.bench-p{processes}", b"", reply=inbox)
        seen = set()
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            while True:
                seen.add((await sub.next_msg(timeout=0.3)).data)
        await sub.unsubscribe()
        if len(seen) >= processes:
            return
        if loop.time() > deadline:
            raise BenchError(f"{len(seen)} of {processes} processes serving after {timeout:g} s")


async def _window(session: Session, subject: str, body: Body, inflight: int, pids: list[int]) -> Sample:
    """One window on ``subject``; the CPU of ``pids`` summed as the responder's."""
    watch = {"loadgen": os.getpid(), **{f"responder:{pid}": pid for pid in pids}}
    if session.nats_pid is not None:
        watch["nats"] = session.nats_pid
    options = session.options
    sample = await drive(
        session.nc,
        subject,
        body.encode(),
        inflight=inflight,
        warmup=options.warmup,
        duration=options.duration,
        timeout=options.timeout,
        check=sampled_count_check(body.count),
        watch=watch,
    )
    cpu = {name: used for name, used in sample.cpu_s.items() if not name.startswith("responder:")}
    cpu["responder"] = sum(used for name, used in sample.cpu_s.items() if name.startswith("responder:"))
    return replace(sample, cpu_s=cpu)


async def processes_cases(
    session: Session, nats_url: str, dsn: str | None, workdir: Path, processes: int
) -> list[CaseResult]:
    """The steady tag's throughput bodies on one worker and on ``processes``, alternating windows."""
    child = _many_child(session, nats_url, dsn, workdir, processes)
    many_subject = f"{session.prefix}-p{processes}.{session.plan.kind}.{session.plan.steady_tag}"
    cases: list[CaseResult] = []
    child.start()
    try:
        await wait_ready(session.nc, child, many_subject, b"")
        await _all_serving(session, child, processes)
        assert child.proc is not None
        many_pids = process_tree(child.proc.pid)
        assert session.worker.proc is not None
        one_pids = [session.worker.proc.pid]
        for inflight in session.options.inflight:
            for body in THROUGHPUT_BODIES:
                one: Sample | None = None
                many: Sample | None = None
                for _ in range(session.options.repeat):
                    one = better(
                        one, await _window(session, session.steady_subject, body, inflight, one_pids)
                    )
                    many = better(many, await _window(session, many_subject, body, inflight, many_pids))
                assert one is not None
                assert many is not None
                pair = []
                for label, subject, sample in (
                    ("1 process", session.steady_subject, one),
                    (f"{processes} processes", many_subject, many),
                ):
                    case = make_case(
                        name=f"{session.plan.mode} {body.label} @{inflight}, {label}",
                        responder="dispenser",
                        kind="processes",
                        mode=session.plan.mode,
                        subject=subject,
                        body=body,
                        inflight=inflight,
                        step=session.plan.steady_step,
                        sample=sample,
                        repetitions=session.options.repeat,
                    )
                    pair.append(case)
                cases += pair
        if child.exited:
            raise BenchError(f"the {child.name} exited during the run:\n{child.tail()}")
    finally:
        child.stop()
    return cases
