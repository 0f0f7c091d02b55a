"""``dispenser bench snowflake``: in-process snowflake IDs/s against the format's ceiling.

The ceiling of one worker is ``2**sequence_bits`` IDs per millisecond (4,096 by default: 4,096,000/s),
less the random start of each millisecond's sequence (on average ``random_start / 2`` IDs). This measures
the pure core (``SnowflakeState.issue`` with the real clock) and the async shell (``SnowflakeGenerator``,
which adds the lease check and the reserved high-water mark), at batches of 1, 100 and 4,096.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.core.snowflake import Issued, SnowflakeLayout, SnowflakeState
from dispenser.ports import SystemClock
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings

__all__ = ["Result", "main", "run_cli"]


@dataclass(frozen=True, slots=True)
class Result:
    """One measured case."""

    case: str
    batch: int
    ids_per_s: float
    calls_per_s: float
    ceiling_ids_per_s: float
    share_of_ceiling: float


def _core_case(
    layout: SnowflakeLayout, batch: int, duration: float, random_start: int
) -> tuple[int, int, float]:
    state = SnowflakeState(layout, 1, random_start=random_start)
    clock = time.time_ns
    ids = calls = 0
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        for _ in range(1000):
            decision = state.issue(clock() // 1_000_000, batch)
            calls += 1
            if type(decision) is Issued:
                ids += batch - decision.remaining
    return ids, calls, time.perf_counter() - start


async def _shell_case(
    layout: SnowflakeLayout, batch: int, duration: float, random_start: int
) -> tuple[int, int, float]:
    async def no_persist(_worker: int, _mark: int) -> None:
        return None

    registry = StaticRegistry(1, max_worker_id=layout.max_worker_id)  # the bench measures the generator
    generator = SnowflakeGenerator(
        layout,
        await registry.register(),
        registry,
        SystemClock(),
        no_persist,
        settings=SnowflakeSettings(random_start=random_start, report_interval=3600.0),
    )
    await generator.start()
    ids = calls = 0
    start = time.perf_counter()
    end = start + duration
    deadline = time.monotonic() + duration + 10
    while time.perf_counter() < end:
        for _ in range(200):
            got = generator.try_take("bench", batch)
            if got is None:
                got = await generator.take("bench", batch, deadline)
            calls += 1
            ids += sum(last - first + 1 for first, last in got.ranges)
    elapsed = time.perf_counter() - start
    await generator.stop()
    return ids, calls, elapsed


def _run_shell(
    layout: SnowflakeLayout, batch: int, duration: float, random_start: int
) -> tuple[int, int, float]:
    return asyncio.run(_shell_case(layout, batch, duration, random_start))


def run(duration: float = 2.0, random_start: int = 100) -> list[Result]:
    """Run every case and return the results."""
    layout = SnowflakeLayout()
    per_ms = layout.max_sequence + 1
    ceiling = per_ms * 1000.0
    results: list[Result] = []
    cases: list[tuple[str, int, Callable[[], tuple[int, int, float]]]] = []
    for batch in (1, 100, 4096):
        cases.append(
            (
                f"core take({batch})",
                batch,
                functools.partial(_core_case, layout, batch, duration, random_start),
            )
        )
    for batch in (1, 100, 4096):
        cases.append(
            (
                f"shell take({batch})",
                batch,
                functools.partial(_run_shell, layout, batch, duration, random_start),
            )
        )
    for name, batch, case in cases:
        ids, calls, elapsed = case()
        results.append(Result(name, batch, ids / elapsed, calls / elapsed, ceiling, ids / elapsed / ceiling))
    return results


def _table(results: Sequence[Result]) -> str:
    lines = [f"{'case':<20} {'IDs/s':>14} {'calls/s':>12} {'of ceiling':>11}"]
    lines += [
        f"{r.case:<20} {r.ids_per_s:>14,.0f} {r.calls_per_s:>12,.0f} {r.share_of_ceiling:>10.1%}"
        for r in results
    ]
    lines.append(f"ceiling: {results[0].ceiling_ids_per_s:,.0f} IDs/s per worker (4,096 per ms)")
    return "\n".join(lines)


def run_cli(argv: Sequence[str]) -> int:
    """``dispenser bench snowflake [--duration S] [--json PATH]``."""
    parser = argparse.ArgumentParser(prog="dispenser bench snowflake", description=__doc__)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per case (default 2)")
    parser.add_argument(
        "--random-start", type=int, default=100, help="as snowflake.random_start (default 100)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(list(argv))
    results = run(args.duration, args.random_start)
    print(_table(results))
    if args.json:
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"python": platform.python_version(), "platform": platform.platform()},
            "cases": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def main() -> int:
    """Entry point for ``python -m dispenser_lab.bench.snowflake_inproc``."""
    import sys  # noqa: PLC0415

    return run_cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
