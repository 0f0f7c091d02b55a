"""The outcome of ``dispenser bench nats``: the targets, the report and its tables, the worker's profile.

:func:`evaluate_targets` compares the cases with the performance targets, :class:`Report` holds a run's
outcome (and is the JSON report, see :mod:`dispenser_lab.bench.stats`), :func:`render_report` prints it.
"""

from __future__ import annotations

import io
import pstats
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispenser.tables import fmt_ms, fmt_rate, fmt_ratio, fmt_us, render_table
from dispenser_lab.bench.nats_plan import THROUGHPUT_BODIES
from dispenser_lab.bench.stats import CaseResult, Target, ratio

__all__ = [
    "IDS_TARGET",
    "RANGES_TARGET",
    "RATE_TARGET",
    "SWITCH_TARGET",
    "Report",
    "by_step",
    "evaluate_targets",
    "profile_summary",
    "render_report",
]

RATE_TARGET = 0.85
"""The dispenser answers at least this fraction of the echo's requests/s (same run, same body)."""
IDS_TARGET = 3_000_000
"""IDs/s with 100 IDs per request."""
SWITCH_TARGET = 1.5
"""p999 of requests on a switch-over over steady p999."""
RANGES_TARGET = 0.85
"""A 10,000-ID ranges request costs "the same as 1": its requests/s over the single-ID rate."""


@dataclass(slots=True)
class Report:
    """The outcome of a run."""

    cases: list[CaseResult]
    targets: list[Target]
    meta: dict[str, Any]
    profile: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (see :mod:`dispenser_lab.bench.stats`)."""
        return {
            **self.meta,
            "cases": [case.as_dict() for case in self.cases],
            "targets": [target.as_dict() for target in self.targets],
        }


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
    keyed = [c for c in cases if c.kind == "request_id"]
    for plain, case in zip(keyed[::2], keyed[1::2], strict=True):
        share = ratio(case.requests_per_s, plain.requests_per_s)
        out.write(
            f"request_id @{case.inflight}: {fmt_rate(case.requests_per_s)} req/s with a fresh one per request, "
            f"{fmt_rate(plain.requests_per_s)} without ({fmt_ratio(share, percent=True)}); p999 "
            f"{fmt_ms(case.p999_ms)} ms vs {fmt_ms(plain.p999_ms)} ms\n"
        )
    several = [c for c in cases if c.kind == "processes"]
    for one, many in zip(several[::2], several[1::2], strict=True):
        out.write(
            f"{many.name}: {fmt_ratio(ratio(many.requests_per_s, one.requests_per_s))} x the requests/s of one "
            f"process, {fmt_ratio(ratio(many.responder_us_per_request, one.responder_us_per_request))} x its "
            "server CPU per request\n"
        )
    _against_plain(out, [c for c in cases if c.kind == "daily"], lambda case: "daily", "a daily tag")
    _against_plain(
        out,
        [c for c in cases if c.kind == "permuted"],
        lambda case: f"permuted {case.format}/{case.count}",
        "a permuted tag",
    )
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


def _against_plain(
    out: io.StringIO, pairs: Sequence[CaseResult], label: Callable[[CaseResult], str], on: str
) -> None:
    """A line per (plain, tag kind) pair of cases, measured alternately: rates, the worker's CPU, p999."""
    for plain, case in zip(pairs[::2], pairs[1::2], strict=True):
        share = ratio(case.requests_per_s, plain.requests_per_s)
        out.write(
            f"{label(case)} @{case.inflight}: {fmt_rate(case.requests_per_s)} req/s on {on}, "
            f"{fmt_rate(plain.requests_per_s)} on a plain one ({fmt_ratio(share, percent=True)}); worker "
            f"{fmt_us(case.responder_us_per_request)} vs {fmt_us(plain.responder_us_per_request)} µs per "
            f"request; p999 {fmt_ms(case.p999_ms)} ms vs {fmt_ms(plain.p999_ms)} ms\n"
        )


def profile_summary(path: Path, lines: int = 30) -> str:
    """The ``lines`` functions with the most own time in the cProfile stats at ``path`` (or why none)."""
    text = io.StringIO()
    try:
        stats = pstats.Stats(str(path), stream=text)
    except (OSError, TypeError, EOFError) as exc:
        return f"<no profile at {path}: {exc}>\n"
    stats.strip_dirs().sort_stats("tottime").print_stats(lines)
    return text.getvalue()
