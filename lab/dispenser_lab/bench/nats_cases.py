"""The cases of ``dispenser bench nats``: what is measured through the started responders, and how.

A :class:`Session` holds the responders and the connection; :func:`throughput_cases`,
:func:`request_id_cases` and :func:`switch_cases` measure echo against dispenser (best windows) and the
switch-over tag against the steady one (pooled windows). The runner: :mod:`~dispenser_lab.bench.nats_bench`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client

from dispenser.tables import fmt_ms, fmt_rate
from dispenser_lab.bench.nats_load import (
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
from dispenser_lab.bench.nats_plan import THROUGHPUT_BODIES, BenchError, BenchOptions, Body, ModePlan
from dispenser_lab.bench.stats import CaseResult, ratio, summarize

__all__ = [
    "Session",
    "better",
    "daily_cases",
    "permuted_cases",
    "reply_sizes",
    "request_id_cases",
    "say",
    "say_case",
    "switch_cases",
    "throughput_cases",
    "with_request_ids",
]


def say(options: BenchOptions, text: str) -> None:
    """A progress line on stderr, unless ``--quiet``."""
    if not options.quiet:
        print(text, file=sys.stderr, flush=True)


def say_case(options: BenchOptions, case: CaseResult) -> None:
    """The progress line of one measured case."""
    say(
        options,
        f"  {case.name:<38} {fmt_rate(case.requests_per_s):>9} req/s  p50 {fmt_ms(case.p50_ms):>6} ms  "
        f"p999 {fmt_ms(case.p999_ms):>7} ms  errors {case.errors + case.timeouts}",
    )


@dataclass(slots=True)
class Session:
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
            with_request_ids(body) if request_id else body.encode(),
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
        say_case(self.options, case)
        return case


async def reply_sizes(session: Session) -> dict[Body, int]:
    """Ask the worker once for each throughput body: is the reply right, and how many bytes is it?"""
    reply_bytes: dict[Body, int] = {}
    for body in THROUGHPUT_BODIES:
        msg = await session.nc.request(session.steady_subject, body.encode(), timeout=session.options.timeout)
        if msg.headers or count_ids(msg.data) != body.count:
            raise BenchError(f"the worker answered {body.label} with {msg.data[:300]!r}")
        reply_bytes[body] = len(msg.data)
    return reply_bytes


async def throughput_cases(session: Session, body: Body, inflight: int, size: int) -> list[CaseResult]:
    """The echo, the sized echo (if the reply is much larger than the body) and the dispenser on ``body``.

    Echo and dispenser run back to back (alternating with --repeat), so that both see the same machine
    load; of N windows each, the best by requests/s counts. A reply much larger than the request (100 IDs
    as JSON) also costs the client and the server: a second echo, answering with a canned body of the
    dispenser's reply size, separates that from the worker's own cost.
    """
    sized_subject = f"{session.prefix}.echo-sized.{size}" if size > len(body.encode()) + 256 else None
    echo_best, sized_best, best = await best_windows(session, body, inflight, sized_subject)
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


def with_request_ids(body: Body) -> Callable[[], bytes]:
    """Bodies like ``body``'s, each with a fresh ``request_id`` (a counter under a random run prefix)."""
    prefix = body.encode()[:-1] + b',"request_id":"' + secrets.token_hex(6).encode() + b"-"
    counter = itertools.count()

    def make() -> bytes:
        return prefix + str(next(counter)).encode() + b'"}'

    return make


async def request_id_cases(session: Session, inflight: int) -> list[CaseResult]:
    """``ids/1`` without and with a fresh ``request_id`` per request, alternating; the best window of each."""
    body = THROUGHPUT_BODIES[0]
    plain: Sample | None = None
    keyed: Sample | None = None
    for _ in range(session.options.repeat):
        plain = better(plain, await session.window(session.steady_subject, body, inflight, None))
        check = sampled_count_check(body.count)
        keyed = better(
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


async def daily_cases(session: Session, inflight: int) -> list[CaseResult]:
    """``ids/1`` on the plain steady tag and on a daily tag of the same step, alternating; the best of each."""
    daily_tag = session.plan.daily_tag
    assert daily_tag is not None
    return await _against_plain(session, inflight, "daily", daily_tag)


async def permuted_cases(session: Session, inflight: int) -> list[CaseResult]:
    """``ids/1`` on the plain steady tag and on a permuted tag of its step, alternating; the best of each.

    One ID a request: a reply of 100 permuted IDs takes ~10 ms of the worker's (each enciphered), longer than
    a tiny run's window at 64 in flight; the cost per ID is ``python -m dispenser_lab.bench.permuted_inproc``'s.
    """
    permuted_tag = session.plan.permuted_tag
    assert permuted_tag is not None
    return await _against_plain(session, inflight, "permuted", permuted_tag)


async def _against_plain(session: Session, inflight: int, kind: str, tag: str) -> list[CaseResult]:
    """``ids/1`` on the plain steady tag and on ``tag`` (a tag of ``kind``), alternating; the best of each."""
    subject = f"{session.prefix}.segment.{tag}"
    body = THROUGHPUT_BODIES[0]
    plain: Sample | None = None
    other: Sample | None = None
    for _ in range(session.options.repeat):
        plain = better(plain, await session.window(session.steady_subject, body, inflight, None))
        check = sampled_count_check(body.count)
        other = better(other, await session.window(subject, body, inflight, check))
    assert plain is not None
    assert other is not None
    return [
        session.record(
            f"segment {body.label} @{inflight} {suffix}",
            responder="dispenser",
            kind=kind,
            subject=each,
            body=body,
            inflight=inflight,
            step=session.plan.steady_step,
            sample=sample,
        )
        for suffix, each, sample in (("plain", session.steady_subject, plain), (kind, subject, other))
    ]


async def best_windows(
    session: Session, body: Body, inflight: int, sized_subject: str | None
) -> tuple[Sample, Sample | None, Sample]:
    """The best window (by requests/s) of the echo, the sized echo (if any) and the dispenser."""
    echo_best: Sample | None = None
    sized_best: Sample | None = None
    best: Sample | None = None
    for _ in range(session.options.repeat):
        echo_best = better(echo_best, await session.window(session.echo_subject, body, inflight, None))
        if sized_subject is not None:
            sized_best = better(sized_best, await session.window(sized_subject, body, inflight, None))
        check = sampled_count_check(body.count)
        best = better(best, await session.window(session.steady_subject, body, inflight, check))
    assert echo_best is not None
    assert best is not None
    return echo_best, sized_best, best


async def switch_cases(session: Session, switch_tag: str, switch_step: int) -> list[CaseResult]:
    """At each concurrency, the small-step tag against the same body on the large-step tag."""
    body = Body("ids", session.options.switch_count)
    switch_subject = f"{session.prefix}.{session.plan.kind}.{switch_tag}"
    await wait_ready(session.nc, session.worker, switch_subject, body.encode())
    cases: list[CaseResult] = []
    for inflight in session.options.inflight:
        split = SwitchSplit(switch_step, body.count)
        reference, switching, windows = await switch_windows(session, switch_subject, body, inflight, split)
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
        add_switch_figures(case, split, ref_case)
        cases += [ref_case, case]
    return cases


async def switch_windows(
    session: Session, switch_subject: str, body: Body, inflight: int, split: SwitchSplit
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
        reference = pooled(reference, await session.window(session.steady_subject, body, inflight, check))
        switching = pooled(switching, await session.window(switch_subject, body, inflight, split.check))
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


def better(best: Sample | None, window: Sample) -> Sample:
    """``window`` if it is the first or faster (by requests/s) than ``best``, else ``best``."""
    return window if best is None or window.rate > best.rate else best


def pooled(pool: Sample | None, window: Sample) -> Sample:
    return window if pool is None else pool.merge(window)


def add_switch_figures(case: CaseResult, split: SwitchSplit, reference: CaseResult) -> None:
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
