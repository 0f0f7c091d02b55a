"""The soak's verdict, its per-phase table and its JSON report.

The JSON report is one object (``schema_version`` 1)::

    {"profile": "short", "seed": 1, "passed": true, "failures": [],
     "totals": {...}, "duplicates": {"snowflake": {"ids": 0, "runs": …, "examples": []}, …},
     "phases": [{"name": …, "fault": …, "duration_s": …, "requests": …, "ids": {"segment": …},
                 "errors": {"unavailable": 3}, "timeouts": …, "p50_ms": …, "notes": {…}}, …],
     "problems": [...], "workers": {...}, "date": …, "wall_s": …}
"""

from __future__ import annotations

import io
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dispenser.tables import fmt_ms, render_table
from dispenser_lab.bench.stats import summarize
from dispenser_lab.soak.ledger import Overlaps, RangeSet
from dispenser_lab.soak.load import PhaseStats, Problem
from dispenser_lab.soak.plan import Profile

__all__ = ["SoakReport", "clock_step_seen", "judge", "phase_dict", "render"]

CLOCK_TOLERANCE_MS = 100
"""How far a stepped worker's clock, as measured over NATS under load, may be from the offset written.
It proves the step took effect (and was not undone); the 10 ms step itself is below what a measurement
over a busy NATS connection can resolve."""


@dataclass(slots=True)
class SoakReport:
    """Everything the run found, and whether it passed."""

    profile: Profile
    seed: int
    phases: list[PhaseStats]
    ledger: dict[str, RangeSet]
    problems: list[Problem]
    workers: dict[str, Any]
    """Per worker: restarts, alive at the end, exit status when stopped."""
    meta: dict[str, Any] = field(default_factory=dict)
    overlaps: dict[str, Overlaps] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No failure found."""
        return not self.failures

    def totals(self) -> dict[str, Any]:
        """The whole run's figures."""
        ids: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        transport: Counter[str] = Counter()
        for phase in self.phases:
            ids.update(phase.ids)
            errors.update(phase.errors)
            transport.update(phase.transport)
        return {
            "requests": sum(p.requests for p in self.phases),
            "good": sum(p.good for p in self.phases),
            "ids": dict(ids),
            "ids_total": sum(ids.values()),
            "errors": dict(errors),
            "timeouts": sum(p.timeouts for p in self.phases),
            "no_responders": sum(p.no_responders for p in self.phases),
            "transport": dict(transport),
            "malformed": sum(p.malformed for p in self.phases),
            "bad_errors": sum(p.bad_errors for p in self.phases),
            "duration_s": round(sum(p.duration_s for p in self.phases), 3),
        }

    def as_dict(self) -> dict[str, Any]:
        """The JSON report."""
        return {
            "profile": self.profile.name,
            "seed": self.seed,
            "passed": self.passed,
            "failures": self.failures,
            **self.meta,
            "totals": self.totals(),
            "duplicates": {
                name: {
                    "ids": self.overlaps[name].ids if name in self.overlaps else None,
                    "received": ranges.ids,
                    "runs": ranges.runs,
                    "examples": [list(map(list, pair)) for pair in self.overlaps[name].examples]
                    if name in self.overlaps
                    else [],
                }
                for name, ranges in sorted(self.ledger.items())
            },
            "phases": [phase_dict(p) for p in self.phases],
            "problems": [vars_of(p) for p in self.problems],
            "workers": self.workers,
        }


def vars_of(problem: Problem) -> dict[str, str]:
    """A problem as a JSON object."""
    return {"phase": problem.phase, "kind": problem.kind, "tag": problem.tag, "what": problem.what}


def phase_dict(stats: PhaseStats) -> dict[str, Any]:
    """One phase as a JSON object."""
    latency = summarize(stats.latencies_ns)
    return {
        "name": stats.phase.name,
        "fault": None if stats.phase.fault is None else stats.phase.fault_label,
        "planned_s": stats.phase.duration_s,
        "duration_s": round(stats.duration_s, 3),
        "requests": stats.requests,
        "kafka_requests": stats.kafka_requests,
        "good": stats.good,
        "ids": dict(stats.ids),
        "ids_total": sum(stats.ids.values()),
        "errors": dict(stats.errors),
        "timeouts": stats.timeouts,
        "no_responders": stats.no_responders,
        "transport": dict(stats.transport),
        "cost_s": round(stats.cost_s, 2),
        "malformed": stats.malformed,
        "bad_errors": stats.bad_errors,
        "must_be_clean": stats.phase.must_be_clean,
        "replies": latency.n,
        "p50_ms": latency.p50_ms,
        "p99_ms": latency.p99_ms,
        "p999_ms": latency.p999_ms,
        "max_ms": latency.max_ms,
        "notes": stats.notes,
    }


def judge(report: SoakReport) -> None:
    """Find duplicates and fill in ``report.failures`` (empty: the run passed)."""
    failures = report.failures
    for name, ranges in sorted(report.ledger.items()):
        found = report.overlaps[name] = ranges.overlaps()
        if found.ids:
            failures.append(f"{found.ids:,} duplicate IDs in {name} (e.g. {list(found.examples[:2])})")
    failures.extend(_total_failures(report))
    for phase in report.phases:
        failures.extend(_phase_failures(phase))
    for name, worker in report.workers.items():
        if not worker.get("alive_at_end"):
            failures.append(f"worker {name} was not running at the end (see its log)")
    if report.meta.get("workers_answering_at_end", 0) < len(report.workers):
        failures.append(
            f"only {report.meta.get('workers_answering_at_end')} of {len(report.workers)} workers answered "
            "$SRV.PING at the end"
        )


def _total_failures(report: SoakReport) -> list[str]:
    """What the whole run got wrong: malformed or bad error replies, too few IDs, a kind of ID missing."""
    failures = []
    totals = report.totals()
    if totals["malformed"]:
        failures.append(f"{totals['malformed']} malformed replies")
    if totals["bad_errors"]:
        failures.append(f"{totals['bad_errors']} error replies not retryable or without a code")
    if totals["ids_total"] < report.profile.min_ids:
        failures.append(
            f"only {totals['ids_total']:,} IDs received, the profile asks for {report.profile.min_ids:,}"
        )
    for kind in ("segment", "snowflake"):
        if not totals["ids"].get(kind):
            failures.append(f"no {kind} IDs at all")
    return failures


def _phase_failures(phase: PhaseStats) -> list[str]:
    """What one phase got wrong: failures where it must be clean, a clock step unseen, no recovery."""
    failures = []
    if phase.phase.must_be_clean:
        if phase.failed_requests:
            failures.append(
                f"phase {phase.phase.name!r} must be clean but had {phase.failed_requests} failed requests "
                f"(errors {dict(phase.errors)}, timeouts {phase.timeouts}, no responders "
                f"{phase.no_responders}, transport {dict(phase.transport)})"
            )
        for kind in ("segment", "snowflake"):
            if not phase.ids.get(kind):
                failures.append(f"phase {phase.phase.name!r} received no {kind} IDs")
    offset = phase.notes.get("clock_offset_ms")
    seen = phase.notes.get("clock_seen_ms")
    if offset is not None and not clock_step_seen(offset, list((seen or {}).values())):
        failures.append(
            f"phase {phase.phase.name!r}: the clock step did not take effect (offset {offset} ms written, "
            f"workers' clocks off by {seen} ms)"
        )
    recovery = phase.notes.get("recovery")
    if isinstance(recovery, str):
        failures.append(f"phase {phase.phase.name!r}: {recovery}")
    served = phase.notes.get("served_again_s")
    if isinstance(served, str):
        failures.append(f"phase {phase.phase.name!r}: the lost datacenter's callers were {served}")
    return failures


def clock_step_seen(offset_ms: int, seen_ms: list[int]) -> bool:
    """Whether one worker's clock is ``offset_ms`` ahead of the others' (within the tolerance).

    Measured against the median of the other workers rather than against zero: a busy event loop delays
    every answer of one query alike, and the unstepped workers show how much.
    """
    for index, value in enumerate(seen_ms):
        others = seen_ms[:index] + seen_ms[index + 1 :]
        baseline = statistics.median(others) if others else 0
        if abs(value - baseline - offset_ms) <= CLOCK_TOLERANCE_MS:
            return True
    return False


def _counts(counter: dict[str, int]) -> str:
    return " ".join(f"{code}:{n}" for code, n in sorted(counter.items())) or "-"


def _notes(notes: dict[str, Any]) -> str:
    parts = []
    recovery = notes.get("recovery")
    if isinstance(recovery, float):
        parts.append(f"all back in {recovery:.1f} s")
    elif recovery is not None:
        parts.append("NOT BACK")
    elif (
        notes.get("action_s", 0) >= 0.5
        and not {"clock_seen_ms", "failover_s", "rejoined_s", "served_again_s"} & notes.keys()
    ):
        parts.append(f"took {notes['action_s']:.1f} s")
    served = notes.get("served_again_s")
    if served is not None:
        parts.append(f"served across after {served:.2f} s" if isinstance(served, float) else "NOT SERVED")
    failover = notes.get("failover_s")
    if failover is not None:
        parts.append(f"new leader after {failover} s" if isinstance(failover, float) else str(failover))
    rejoined = notes.get("rejoined_s")
    if rejoined is not None:
        parts.append(f"whole again after {rejoined:.1f} s")
    thawed = notes.get("thawed_s")
    if thawed is not None:
        parts.append(f"whole {thawed:.1f} s after the thaw")
    seen = notes.get("clock_seen_ms")
    if seen is not None:
        parts.append("clocks " + " ".join(f"w{w}:{ms:+d}ms" for w, ms in seen.items()))
    return "; ".join(parts)


def _millions(n: int) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 10_000 else f"{n:,}"


def render(report: SoakReport) -> str:
    """The table printed at the end, with the verdict."""
    rows: list[list[str]] = []
    phases: Sequence[dict[str, Any]] = [phase_dict(p) for p in report.phases]
    for p in phases:
        notes = p["notes"]
        rows.append(
            [
                p["name"],
                p["fault"] or "-",
                f"{p['duration_s']:.1f}",
                f"{p['requests']:,}",
                _millions(p["ids"].get("segment", 0)),
                _millions(p["ids"].get("snowflake", 0)),
                _counts(p["errors"]),
                str(p["timeouts"]),
                str(p["no_responders"] + sum(p["transport"].values())),
                f"{p['cost_s']:.1f}" if p["cost_s"] else "-",
                fmt_ms(p["p50_ms"]),
                fmt_ms(p["p99_ms"]),
                fmt_ms(p["p999_ms"]),
                _notes(notes),
            ]
        )
    totals = report.totals()
    rows.append(
        [
            "total",
            "",
            f"{totals['duration_s']:.1f}",
            f"{totals['requests']:,}",
            _millions(totals["ids"].get("segment", 0)),
            _millions(totals["ids"].get("snowflake", 0)),
            _counts(totals["errors"]),
            str(totals["timeouts"]),
            str(totals["no_responders"] + sum(totals["transport"].values())),
            "",
            "",
            "",
            "",
            "",
        ]
    )
    headers = ["phase", "fault", "s", "requests", "seg IDs", "sf IDs", "errors by code", "timeouts"]
    headers += ["no-resp", "cost s", "p50 ms", "p99 ms", "p999 ms", "notes"]
    out = io.StringIO()
    meta = report.meta
    out.write(
        f"scripts/soak --profile {report.profile.name} --seed {report.seed} — {meta.get('date', '')} — "
        f"{report.profile.clients} clients x {report.profile.inflight} in flight, "
        f"{report.profile.count_range[0]:,}-{report.profile.count_range[1]:,} IDs per request\n\n"
    )
    out.write(render_table(headers, rows) + "\n\n")
    for name, ranges in sorted(report.ledger.items()):
        found = report.overlaps.get(name)
        dup = "?" if found is None else f"{found.ids:,}"
        out.write(f"{name:<20} {ranges.ids:>15,} IDs in {ranges.runs:>9,} runs, duplicates: {dup}\n")
    out.write(
        f"malformed replies: {totals['malformed']}, error replies not retryable or uncoded: "
        f"{totals['bad_errors']}\n"
    )
    for problem in report.problems[:10]:
        out.write(f"  {problem.phase}: {problem.kind}.{problem.tag}: {problem.what}\n")
    if (enriched := meta.get("enrichment")) is not None:
        out.write(
            f"enrichment (read_committed): {enriched['fed']:,} records fed, {enriched['enriched']:,} enriched, "
            f"{enriched['dead_lettered']:,} dead-lettered; twice {enriched['twice']}, missing "
            f"{enriched['missing']}, misplaced {enriched['misplaced']}; all committed "
            f"{enriched['caught_up_s']} s after the feed stopped; enricher killed "
            f"{meta.get('enricher_restarts', 0)} times\n"
        )
    restarts = ", ".join(f"{name} {w['restarts']}" for name, w in report.workers.items())
    out.write(f"worker restarts: {restarts}; wall time {meta.get('wall_s', 0):.0f} s\n")
    if report.passed:
        out.write("\nPASS\n")
    else:
        out.write("\nFAIL\n" + "".join(f"  - {failure}\n" for failure in report.failures))
    return out.getvalue()
