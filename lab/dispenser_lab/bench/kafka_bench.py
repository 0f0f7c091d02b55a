"""``dispenser bench kafka``: the dispenser's Kafka paths against their trivial baselines, on one broker.

Request/reply against :mod:`dispenser_lab.bench.kafka_echo`, and the enricher against a plain transactional
copy loop (``--backoff-override`` patches aiokafka's 20 ms commit backoff for both). What runs and the
figures: ``docs/benchmarks.md`` ("Kafka").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from dispenser.adapters.kafka.connection import ensure_topics
from dispenser.config import KafkaConfig
from dispenser.ports import IdSource
from dispenser_lab.bench.kafka_load import BODY, TAG, CopyLoop, Requester, drive, timed_rate, unique
from dispenser_lab.bench.kafka_report import (
    Report,
    enrichment_target,
    render,
    request_reply_target,
    write_report,
)
from dispenser_lab.bench.stats import ratio, summarize

__all__ = ["KafkaBenchOptions", "main", "run"]


@dataclass(frozen=True, slots=True)
class KafkaBenchOptions:
    """What to measure, and against which servers."""

    bootstrap: str | None = None
    postgres_dsn: str | None = None
    duration: float = 5.0
    warmup: float = 2.0
    inflight: tuple[int, ...] = (1, 64)
    records: int = 100_000
    batches: tuple[int, ...] = (100, 1000)
    backoff_override: float | None = None
    parts: tuple[str, ...] = ("request-reply", "enrichment")
    rounds: int = 2
    """Each case runs this many times, alternating baseline and dispenser; the best of each counts (the
    first seconds of a fresh broker are slower, and whoever went first would pay for it)."""
    json_path: Path | None = None
    quiet: bool = False


def _say(options: KafkaBenchOptions, text: str) -> None:
    if not options.quiet:
        print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _child(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=os.environ | env, stdout=out, stderr=out)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path) -> str:
    return log.read_text()[-2000:]


async def _wait_answering(requester: Requester, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"responder exited with {proc.returncode}: {_tail(log)}")
        try:
            await requester.ask(BODY, timeout=2.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"responder did not answer within 60 s: {_tail(log)}") from None


def _responder_argv(
    responder: str, bootstrap: str, dsn: str, requests: str, replies: str
) -> tuple[list[str], dict[str, str]]:
    group = unique(responder)
    if responder == "echo":
        argv = [sys.executable, "-m", "dispenser_lab.bench.kafka_echo", "--bootstrap", bootstrap]
        return [*argv, "--topic", requests, "--group", group], {}
    return [sys.executable, "-m", "dispenser", "serve"], {
        "DISPENSER_NATS_ENABLED": "false",
        "DISPENSER_KAFKA_ENABLED": "true",
        "DISPENSER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "DISPENSER_KAFKA_REQUEST_TOPIC": requests,
        "DISPENSER_KAFKA_REPLY_TOPIC": replies,
        "DISPENSER_KAFKA_GROUP_ID": group,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_LOG_LEVEL": "WARNING",
    }


async def _request_reply(
    options: KafkaBenchOptions, bootstrap: str, dsn: str, workdir: Path, report: Report
) -> None:
    kafka = KafkaConfig(bootstrap_servers=bootstrap)
    requesters: dict[str, Requester] = {}
    with contextlib.ExitStack() as children:
        try:
            for responder in ("echo", "dispenser"):
                requests, replies = unique(f"{responder}.requests"), unique(f"{responder}.replies")
                await ensure_topics(kafka, {requests: 1, replies: 1})
                argv, env = _responder_argv(responder, bootstrap, dsn, requests, replies)
                log = workdir / f"{responder}.log"
                proc = children.enter_context(_child(argv, env, log))
                requesters[responder] = requester = Requester(bootstrap, requests, replies)
                await requester.start()
                await _wait_answering(requester, proc, log)
            best: dict[tuple[str, int], dict[str, Any]] = {}
            for inflight in options.inflight:
                for round_ in range(1, options.rounds + 1):
                    for responder, requester in requesters.items():
                        _say(options, f"request/reply: {responder}, {inflight} in flight, round {round_}")
                        await drive(requester, inflight, options.warmup)
                        count, latencies, elapsed = await drive(requester, inflight, options.duration)
                        lat = summarize(latencies)
                        case = {
                            "responder": responder,
                            "inflight": inflight,
                            "requests": count,
                            "requests_per_s": round(count / elapsed, 1),
                            "p50_ms": lat.p50_ms,
                            "p99_ms": lat.p99_ms,
                            "p999_ms": lat.p999_ms,
                            "errors": requester.errors,
                            "rounds": options.rounds,
                        }
                        key = (responder, inflight)
                        if key not in best or case["requests_per_s"] > best[key]["requests_per_s"]:
                            best[key] = case
        finally:
            for requester in requesters.values():
                await requester.stop()
    for inflight in options.inflight:
        echo, ours = best[("echo", inflight)], best[("dispenser", inflight)]
        share = ratio(float(ours["requests_per_s"]), float(echo["requests_per_s"]))
        ours["ratio_to_echo"] = share
        report.request_reply += [echo, ours]
        report.targets.append(request_reply_target(inflight, share))


async def _copy_once(
    kafka: KafkaConfig, source: str, *, batch: int, records: int, loop_kind: str, source_ids: IdSource
) -> float:
    """Copy (or enrich) the whole input topic to a fresh output topic once; records per second."""
    from dispenser.adapters.kafka.enrich import Enricher, EnrichSettings  # noqa: PLC0415
    from dispenser.service.enrichment import Placement  # noqa: PLC0415

    target = unique(f"{loop_kind}.out")
    await ensure_topics(kafka, {target: 1})
    if loop_kind == "copy":
        copier = CopyLoop(kafka.bootstrap_servers, source, target, batch)
        task = asyncio.create_task(copier.run(records))
        rate = await timed_rate(lambda: copier.committed, records, task)
        await task
        return rate
    settings = EnrichSettings(
        input_topic=source,
        output_topic=target,
        tag=TAG,
        placement=Placement.from_options(field="id"),
        group_id=unique("enrich"),
        commit_records=batch,
        commit_interval=1.0,
    )
    enricher = Enricher(kafka, settings, source_ids)
    await enricher.start()
    stop = asyncio.Event()
    task = asyncio.create_task(enricher.run(stop))
    rate = await timed_rate(lambda: enricher.stats.enriched, records, task)
    stop.set()
    await task
    return rate


async def _enrichment(options: KafkaBenchOptions, bootstrap: str, dsn: str, report: Report) -> None:
    from dispenser.app import Worker  # noqa: PLC0415
    from dispenser.config import load_config  # noqa: PLC0415

    kafka = KafkaConfig(bootstrap_servers=bootstrap)
    source = unique("enrich.in")
    await ensure_topics(kafka, {source: 1})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    await producer.start()
    try:
        sends = [
            await producer.send(
                source, json.dumps({"n": i, "sku": "abcdefgh", "qty": 3}).encode(), key=b"k%d" % i
            )
            for i in range(options.records)
        ]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    config = load_config(
        environ={
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_NATS_ENABLED": "false",
            "DISPENSER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        }
    )
    worker = Worker(config, serve=False)
    await worker.start()
    try:
        rates: dict[tuple[str, int], float] = {}
        for batch in options.batches:
            for round_ in range(1, options.rounds + 1):
                for loop_kind in ("copy", "enrich"):
                    _say(options, f"enrichment: {loop_kind}, commit every {batch}, round {round_}")
                    rate = await _copy_once(
                        kafka,
                        source,
                        batch=batch,
                        records=options.records,
                        loop_kind=loop_kind,
                        source_ids=worker.allocator,
                    )
                    _say(options, f"  {rate:,.0f} records/s")
                    rates[(loop_kind, batch)] = max(rate, rates.get((loop_kind, batch), 0.0))
            for loop_kind in ("copy", "enrich"):
                report.enrichment.append(
                    {
                        "loop": loop_kind,
                        "commit_records": batch,
                        "records_per_s": round(rates[(loop_kind, batch)], 1),
                    }
                )
    finally:
        await worker.stop()
    for batch in options.batches:
        share = ratio(rates[("enrich", batch)], rates[("copy", batch)])
        for case in report.enrichment:
            if case["loop"] == "enrich" and case["commit_records"] == batch:
                case["ratio_to_copy"] = share
        report.targets.append(enrichment_target(batch, share))


async def _prepare_tag(dsn: str) -> None:
    from dispenser.adapters.postgres.schema import migrate  # noqa: PLC0415
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415
    from dispenser.core.errors import TagExists  # noqa: PLC0415

    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        with contextlib.suppress(TagExists):
            await store.add_tag(TAG, 1_000_000, start=10**12, description="dispenser bench kafka")


async def _measure(options: KafkaBenchOptions, bootstrap: str, dsn: str, workdir: Path) -> Report:
    if options.backoff_override is not None:
        # Private aiokafka constant, patched in the benchmark only (both loops alike), never in the product.
        from aiokafka.producer import sender  # noqa: PLC0415

        sender.BACKOFF_OVERRIDE = options.backoff_override
    await _prepare_tag(dsn)
    report = Report()
    if "request-reply" in options.parts:
        await _request_reply(options, bootstrap, dsn, workdir, report)
    if "enrichment" in options.parts:
        await _enrichment(options, bootstrap, dsn, report)
    return report


def run(options: KafkaBenchOptions) -> Report:
    """Start what is missing (broker, PostgreSQL), measure, stop what was started."""
    from dispenser.runner import run_async  # noqa: PLC0415
    from dispenser_lab.servers import KafkaBroker, PostgresServer  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="dispenser-bench-kafka-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # PostgreSQL runs as its own user below it when we are root
        broker = postgres = None
        try:
            bootstrap = options.bootstrap
            if bootstrap is None:
                _say(options, "starting a Kafka broker")
                broker = KafkaBroker(workdir / "kafka")
                broker.start()
                bootstrap = broker.bootstrap
            dsn = options.postgres_dsn
            if dsn is None:
                postgres = PostgresServer(workdir / "postgres")
                postgres.start()
                dsn = postgres.dsn
            return run_async(_measure(options, bootstrap, dsn, workdir))
        finally:
            if postgres is not None:
                postgres.stop()
            if broker is not None:
                broker.stop()


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main(argv: Sequence[str]) -> int:
    """``dispenser bench kafka [options]``: print the tables, write the JSON report if asked."""
    parser = argparse.ArgumentParser(
        prog="dispenser bench kafka",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    parser.add_argument("--postgres-dsn", help="use this database instead of starting a server")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per request/reply case")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up before each case")
    parser.add_argument("--inflight", type=_numbers, default=(1, 64), help="comma-separated, default 1,64")
    parser.add_argument("--records", type=int, default=100_000, help="records per enrichment run")
    parser.add_argument(
        "--batches", type=_numbers, default=(100, 1000), help="commit batches, default 100,1000"
    )
    parser.add_argument("--backoff-override", type=float, help="patch aiokafka's 20 ms post-commit back-off")
    parser.add_argument(
        "--only", choices=["request-reply", "enrichment"], help="measure one part only (default: both)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per case; the best counts")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if not args.quiet:
        # The workers' INFO lines (partitions taken over, groups joined) would drown the progress lines.
        logging.getLogger().setLevel(logging.WARNING)
    options = KafkaBenchOptions(
        bootstrap=args.bootstrap,
        postgres_dsn=args.postgres_dsn,
        duration=args.duration,
        warmup=args.warmup,
        inflight=args.inflight,
        records=args.records,
        batches=args.batches,
        backoff_override=args.backoff_override,
        parts=(args.only,) if args.only else ("request-reply", "enrichment"),
        rounds=args.rounds,
        json_path=args.json,
        quiet=args.quiet,
    )
    report = run(options)
    print(render(report))
    if options.json_path is not None:
        write_report(
            options.json_path,
            report,
            {
                "duration": options.duration,
                "warmup": options.warmup,
                "records": options.records,
                "backoff_override": options.backoff_override,
            },
        )
    return 0
