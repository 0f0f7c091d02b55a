"""Numbers for the benchmarks: latency percentiles, the record of one case, targets, JSON.

The text tables are :mod:`dispenser.tables`, shared with ``watch`` and the soak. The JSON report's shape
(flat case and target records) is in ``docs/benchmarks.md`` ("JSON").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CaseResult",
    "Latency",
    "Target",
    "host_meta",
    "percentile",
    "summarize",
    "write_json",
]

SCHEMA_VERSION = 1


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank ``q``-quantile (0 < q ≤ 1) of values sorted in increasing order.

    The nearest rank is an observed value, never an interpolation: p999 of 1,000 samples is the largest.

    Raises:
        ValueError: no values, or ``q`` outside (0, 1].
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q must be within (0, 1], got {q}")
    rank = math.ceil(q * len(sorted_values))
    return sorted_values[max(rank, 1) - 1]


@dataclass(frozen=True, slots=True)
class Latency:
    """Latency percentiles of a set of requests, in milliseconds."""

    n: int
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None


def summarize(latencies_ns: Iterable[int]) -> Latency:
    """Percentiles of latencies given in nanoseconds (all ``None`` when there are none)."""
    values = sorted(latencies_ns)
    if not values:
        return Latency(0, None, None, None, None)

    def ms(ns: int) -> float:
        return round(ns / 1e6, 4)

    return Latency(
        n=len(values),
        p50_ms=ms(percentile(values, 0.50)),
        p99_ms=ms(percentile(values, 0.99)),
        p999_ms=ms(percentile(values, 0.999)),
        max_ms=ms(values[-1]),
    )


@dataclass(slots=True, kw_only=True)
class CaseResult:
    """One measured case: a responder, a request body, a number of requests in flight.

    ``ids_per_s`` is ``None`` for the echo responder (it hands out no IDs). The ``switch_*``,
    ``steady_*`` and ``reference_*`` fields are set only for the segment switch-over cases.
    """

    name: str
    responder: str
    """``echo`` or ``dispenser``."""
    kind: str
    """``throughput``; ``sized`` (the echo answering with a body of the dispenser's reply size);
    ``reference`` (the switch-over body on the large-step tag) or ``switch``."""
    mode: str | None
    """The dispenser's generator (``segment``; ``snowflake`` later); ``None`` for the echo."""
    subject: str
    format: str
    count: int
    inflight: int
    step: int | None
    duration_s: float
    requests: int
    errors: int
    timeouts: int
    requests_per_s: float
    ids_per_s: float | None
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None
    repetitions: int = 1
    cpu_responder: float | None = None
    """CPU the responder process used while measured, as a share of one core (Linux; else ``None``)."""
    cpu_loadgen: float | None = None
    """The same for the load generator (the bench process)."""
    cpu_nats: float | None = None
    """The same for nats-server, when the bench started it."""
    responder_us_per_request: float | None = None
    """Responder CPU per answered request, in microseconds: what a request costs the responder, much
    less sensitive to other load on the machine than requests/s."""
    """Measured windows behind the figures: the best of them (throughput), or all pooled (switch-overs)."""
    reply_bytes: int | None = None
    """Size of the replies (the dispenser's measured once before the run; the echo's is the body's)."""
    ratio_to_echo: float | None = None
    """requests/s of this case over the echo's, same body and same number in flight."""
    ratio_to_sized_echo: float | None = None
    """requests/s over an echo answering with a body as large as the dispenser's reply (kind ``sized``):
    the worker's own cost, without what a large reply costs the client and the server."""
    switch_requests: int | None = None
    """Replies that received the first IDs of a new segment (a switch-over happened on them)."""
    switch_p50_ms: float | None = None
    switch_p99_ms: float | None = None
    switch_p999_ms: float | None = None
    steady_requests: int | None = None
    """The other replies of the same run."""
    steady_p50_ms: float | None = None
    steady_p99_ms: float | None = None
    steady_p999_ms: float | None = None
    switch_ratio_p999: float | None = None
    """``switch_p999_ms / steady_p999_ms``: the target is ≤ 1.5."""
    reference_p999_ms: float | None = None
    """p999 of the same body and concurrency on the large-step tag (no switch-overs)."""
    reference_ratio_p999: float | None = None
    """``p999_ms`` (every request of this run) over ``reference_p999_ms``."""

    def as_dict(self) -> dict[str, Any]:
        """The case as a flat JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Target:
    """A goal from the design, and whether this run met it."""

    name: str
    measured: str
    goal: str
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        """The target as a flat JSON-ready dict."""
        return dataclasses.asdict(self)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` rounded to 3 places, or ``None`` if either is missing or zero."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write the report, pretty-printed, creating the parent directory if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **report}, indent=2) + "\n")


def host_meta(started: datetime.datetime, load_before: tuple[float, float, float]) -> dict[str, object]:
    """A report's first lines: when it ran, on what host, the load average before it and now."""
    return {
        "date": started.isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
