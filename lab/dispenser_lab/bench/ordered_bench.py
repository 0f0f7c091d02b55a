"""An ordered tag against a plain one, side by side: ``python -m dispenser_lab.bench.ordered_bench``.

Starts NATS and PostgreSQL (from the kit, unless given), ``--workers`` ``dispenser serve`` processes in one
queue group, a plain and an ordered tag of the same step; then alternates windows of ``--inflight``
requests kept outstanding on each tag and prints the best window of each (replies/s, p50 and p99 latency,
the workers' CPU). The ordered tag's replies are checked as they arrive: each one's first ID above every ID
received before (a violation counts as an error). Figures: docs/ordered.md, docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec
import nats
from nats.aio.msg import Msg

from dispenser.messages import Reply
from dispenser_lab.bench.nats_load import Child, Sample, drive, wait_ready
from dispenser_lab.bench.servers import bench_servers, prepare_tags

__all__ = ["main"]

PLAIN, ORDERED = "bench-plain", "bench-ordered"


def increasing() -> tuple[list[int], object]:
    """A reply check: each reply's first ID above the highest received before (the list counts violations)."""
    highest = [-1]
    violations: list[int] = []
    decoder = msgspec.json.Decoder(Reply)

    def check(msg: Msg, _latency: int) -> bool:
        reply = decoder.decode(msg.data)
        ranges = reply.ranges or [(i, i) for i in reply.ids or []]
        if not ranges or ranges[0][0] <= highest[0]:
            violations.append(1)
            return False
        highest[0] = ranges[-1][1]
        return True

    return violations, check


def _line(name: str, sample: Sample, workers: dict[str, int]) -> str:
    lat = sorted(sample.latencies_ns)
    p50 = statistics.median(lat) / 1e6 if lat else float("nan")
    p99 = lat[int(len(lat) * 0.99) - 1] / 1e6 if lat else float("nan")
    cpu = sum(sample.cpu_share().get(w, 0.0) for w in workers)
    return (
        f"| {name} | {sample.rate:,.0f} | {p50:.2f} | {p99:.2f} | {sample.errors} | {sample.timeouts} | "
        f"{cpu:.2f} |"
    )


async def _run(args: argparse.Namespace, nats_url: str, dsn: str, workdir: Path) -> None:
    from dispenser.adapters.postgres.ordered import set_ordered  # noqa: PLC0415
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    await prepare_tags(dsn, [(PLAIN, args.step, 1), (ORDERED, args.step, 1)])
    async with await PostgresSegmentStore.connect(dsn) as store:
        await set_ordered(store, ORDERED, 3.0)
    env = os.environ | {"DISPENSER_NATS_URL": nats_url, "DISPENSER_POSTGRES_DSN": dsn}
    children = [
        Child(
            f"worker{i}",
            [sys.executable, "-m", "dispenser", "serve"],
            workdir / f"worker{i}.log",
            env | {"DISPENSER_SEGMENT_STATE_DIR": str(workdir / f"state{i}")},
        )
        for i in range(args.workers)
    ]
    nc = await nats.connect(nats_url)
    try:
        for child in children:
            child.start()
        body = b'{"count": %d}' % args.count
        for child in children:
            await wait_ready(nc, child, f"leaf.segment.{PLAIN}", body)
            await wait_ready(nc, child, f"leaf.segment.{ORDERED}", body)
        watch = {c.name: c.proc.pid for c in children if c.proc is not None}
        best: dict[str, Sample] = {}
        bad = 0
        for _ in range(args.rounds):
            for tag in (PLAIN, ORDERED):
                violations, check = increasing() if tag == ORDERED else ([], None)
                sample = await drive(
                    nc,
                    f"leaf.segment.{tag}",
                    body,
                    inflight=args.inflight,
                    warmup=0.5,
                    duration=args.duration,
                    timeout=5.0,
                    check=check,  # type: ignore[arg-type]
                    watch=watch,
                )
                bad += len(violations)
                if tag not in best or sample.rate > best[tag].rate:
                    best[tag] = sample
        print(f"{args.workers} workers, {args.inflight} in flight, count {args.count}, step {args.step}")
        print("| tag | replies/s | p50 ms | p99 ms | errors | timeouts | workers' CPU (cores) |")
        print("|---|---|---|---|---|---|---|")
        for tag in (PLAIN, ORDERED):
            print(_line(tag, best[tag], watch))
        print(f"ordered: {bad} replies not above every ID received before them")
    finally:
        await nc.close()
        for child in children:
            child.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its table."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.ordered_bench", description=__doc__)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--step", type=int, default=100_000)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nats-url")
    parser.add_argument("--postgres-dsn")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ordered-bench-") as tmp:
        workdir = Path(tmp)
        with bench_servers(workdir, args.nats_url, args.postgres_dsn) as (nats_url, _pid, dsn):
            assert dsn is not None
            asyncio.run(_run(args, nats_url, dsn, workdir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
