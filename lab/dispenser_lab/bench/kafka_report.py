"""What ``dispenser bench kafka`` reports: the measured cases, the targets they meet, the tables, the JSON.

The runner (:mod:`~dispenser_lab.bench.kafka_bench`) fills a :class:`Report`; :func:`request_reply_target` and
:func:`enrichment_target` are the goals of ``docs/benchmarks.md`` ("Kafka").
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispenser.tables import fmt_ms, fmt_rate, fmt_ratio, render_table
from dispenser_lab.bench.stats import write_json

__all__ = ["Report", "enrichment_target", "render", "request_reply_target", "write_report"]


@dataclass
class Report:
    """Everything one run measured."""

    request_reply: list[dict[str, Any]] = field(default_factory=list)
    enrichment: list[dict[str, Any]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)


def request_reply_target(inflight: int, share: float | None) -> dict[str, Any]:
    """The dispenser's request/reply rate at ``inflight`` should be at least 85% of the echo's."""
    return {
        "name": f"request/reply vs echo @{inflight}",
        "measured": fmt_ratio(share, percent=True),
        "goal": ">= 85%",
        "passed": share is not None and share >= 0.85,
    }


def enrichment_target(batch: int, share: float | None) -> dict[str, Any]:
    """The enricher, committing every ``batch`` records, should copy at least 80% as fast as the copy loop."""
    return {
        "name": f"enrichment vs copy loop, commit {batch}",
        "measured": fmt_ratio(share, percent=True),
        "goal": ">= 80%",
        "passed": share is not None and share >= 0.8,
    }


def render(report: Report) -> str:
    """The report as text tables."""
    rr = render_table(
        ["request/reply", "in flight", "req/s", "p50 ms", "p99 ms", "vs echo"],
        [
            [
                c["responder"],
                str(c["inflight"]),
                fmt_rate(c["requests_per_s"]),
                fmt_ms(c["p50_ms"]),
                fmt_ms(c["p99_ms"]),
                fmt_ratio(c.get("ratio_to_echo"), percent=True),
            ]
            for c in report.request_reply
        ],
    )
    en = render_table(
        ["enrichment", "commit every", "records/s", "vs copy"],
        [
            [
                c["loop"],
                str(c["commit_records"]),
                fmt_rate(c["records_per_s"]),
                fmt_ratio(c.get("ratio_to_copy"), percent=True),
            ]
            for c in report.enrichment
        ],
    )
    targets = render_table(
        ["targets", "measured", "goal", "met"],
        [[t["name"], t["measured"], t["goal"], "yes" if t["passed"] else "NO"] for t in report.targets],
    )
    parts = [rr if report.request_reply else "", en if report.enrichment else "", targets]
    return "\n\n".join(part for part in parts if part)


def write_report(path: Path, report: Report, settings: dict[str, Any]) -> None:
    """Write ``report`` as JSON to ``path``, with the date, the host and the run's ``settings``."""
    write_json(
        path,
        {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
            "settings": settings,
            "request_reply": report.request_reply,
            "enrichment": report.enrichment,
            "targets": report.targets,
        },
    )
