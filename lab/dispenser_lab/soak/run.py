"""The soak command: start everything, run the load through the profile's phases, judge, report.

``scripts/soak --profile short|long [--json PATH] [--seed N] [--workdir DIR]``; also
``python -m dispenser_lab.soak``. Exit status 0 when the run passed, 1 when it failed, 2 when it could not run
(a server or worker would not start, libfaketime missing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from dispenser.config import KafkaConfig
from dispenser.runner import run_async
from dispenser_lab.bench.stats import write_json
from dispenser_lab.servers import DevServerError
from dispenser_lab.soak.cluster import (
    KAFKA_REPLY_TOPIC,
    KAFKA_REQUEST_TOPIC,
    SoakCluster,
    SoakError,
    count_workers,
)
from dispenser_lab.soak.enrich import ENRICH_TAG, EnrichResult, EnrichStream
from dispenser_lab.soak.faketime import FaketimeMissing, ensure_libfaketime
from dispenser_lab.soak.ledger import RangeSet, runs_of
from dispenser_lab.soak.load import LoadGenerator, PhaseStats
from dispenser_lab.soak.plan import PROFILES, WORKERS, Phase, Profile, scaled
from dispenser_lab.soak.report import SoakReport, judge, render

__all__ = ["SoakOptions", "main", "run"]

RECOVERY_WAIT_S = 60.0
"""How long after a fault's phase the workers may take to all answer again before the run fails."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakOptions:
    """What the command was asked for."""

    profile: Profile
    seed: int = 1
    json_path: Path | None = None
    workdir: Path | None = None
    """Keep servers' data and logs here; default: a temporary directory, removed after a passing run."""
    install: bool = True
    """Install Debian's faketime package if libfaketime is missing (as root, with apt-get)."""
    quiet: bool = False


def _say(options: SoakOptions, text: str) -> None:
    if not options.quiet:
        print(f"soak: {text}", file=sys.stderr, flush=True)


async def _wait_for_ids(nc: Client, profile: Profile, timeout: float = 60.0) -> None:
    """Wait until every tag of both kinds answers with an ID (the workers have loaded their tags)."""
    subjects = [f"leaf.segment.{tag}" for tag in profile.segment_tags]
    subjects += [f"leaf.snowflake.{tag}" for tag in profile.snowflake_tags]
    deadline = time.monotonic() + timeout
    for subject in subjects:
        while True:
            try:
                msg = await nc.request(subject, b"", timeout=2.0)
                if not msg.headers:
                    break
                last = msg.data.decode(errors="replace")
            except nats.errors.Error as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                raise SoakError(f"no ID on {subject} after {timeout:g} s: {last}")
            await asyncio.sleep(0.2)


async def _run_phase(
    options: SoakOptions, cluster: SoakCluster, load: LoadGenerator, control: Client, phase: Phase
) -> PhaseStats:
    stats = PhaseStats(phase, started=time.monotonic())
    load.phase = stats
    if phase.fault is not None:
        stats.notes = await cluster.inject(phase.fault, control)
    await asyncio.sleep(max(0.0, stats.started + phase.duration_s - time.monotonic()))
    # A phase whose fault needs the workers back (a restarted worker, a restarted NATS) lasts until they
    # are: the next fault must hit a recovered fleet, or it would test the overlap of two faults instead.
    await _resolve_recovery(stats)
    stats.ended = time.monotonic()
    _say(
        options,
        f"{phase.name:<24} {phase.fault_label:<20} {stats.requests:>8,} requests  "
        f"{sum(stats.ids.values()) / 1e6:>8.2f}M IDs  errors {dict(stats.errors) or 0}  "
        f"timeouts {stats.timeouts}  total {load.total_ids / 1e6:.1f}M",
    )
    return stats


async def _top_up(options: SoakOptions, load: LoadGenerator, phases: list[PhaseStats]) -> None:
    """Go on in a last steady phase until the profile's ID count is reached (or ``max_extra_s`` passes)."""
    profile = options.profile
    if load.total_ids >= profile.min_ids:
        return
    stats = PhaseStats(Phase("top-up", profile.max_extra_s), started=time.monotonic())
    load.phase = stats
    # Polled: the requesters add IDs at every reply, and an event set on every reply would cost more.
    while load.total_ids < profile.min_ids and time.monotonic() - stats.started < profile.max_extra_s:  # noqa: ASYNC110
        await asyncio.sleep(0.25)
    stats.ended = time.monotonic()
    phases.append(stats)
    _say(options, f"top-up: {load.total_ids / 1e6:.1f}M IDs in all")


async def _resolve_recovery(stats: PhaseStats) -> None:
    """Replace the phase's recovery task by the seconds it took (or by why it failed)."""
    task = stats.notes.get("recovery")
    if not isinstance(task, asyncio.Task):
        return
    try:
        stats.notes["recovery"] = await asyncio.wait_for(task, RECOVERY_WAIT_S)
    except (SoakError, TimeoutError) as exc:
        stats.notes["recovery"] = f"the workers did not all come back: {exc or 'timed out'}"


async def _soak(
    options: SoakOptions, cluster: SoakCluster
) -> tuple[list[PhaseStats], LoadGenerator, int, EnrichResult | None]:
    profile = options.profile
    await cluster.prepare_database()
    cluster.start_workers()

    async def quiet(_exc: Exception) -> None:
        """Reconnect attempts fail while NATS restarts: expected, and not worth a traceback each."""

    control = await nats.connect(
        cluster.nats_urls,
        name="soak-control",
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        error_cb=quiet,
    )
    phases: list[PhaseStats] = []
    kafka = None
    if cluster.kafka is not None:
        kafka = KafkaConfig(
            bootstrap_servers=cluster.kafka.bootstrap,
            request_topic=KAFKA_REQUEST_TOPIC,
            reply_topic=KAFKA_REPLY_TOPIC,
        )
    load = LoadGenerator(profile, cluster.nats_urls, options.seed, kafka=kafka)
    stream = None
    enrichment = None
    try:
        took = await cluster.wait_workers(control)
        await _wait_for_ids(control, profile)
        _say(options, f"3 workers ready after {took:.1f} s; load starts")
        if kafka is not None and profile.enrich_rate:
            stream = EnrichStream(KafkaConfig(bootstrap_servers=kafka.bootstrap_servers), profile.enrich_rate)
            await stream.create_topics()
            cluster.start_enricher()
            await stream.start_feeding()
        await load.start()
        for phase in profile.phases:
            phases.append(await _run_phase(options, cluster, load, control, phase))
        await _top_up(options, load, phases)
        load.phase = None
        await load.stop()
        if stream is not None:
            await stream.stop_feeding()
            _say(options, f"enrichment: {stream.sent:,} records fed; waiting for the enricher to finish")
            enrichment = await stream.finish()
            # The enricher draws from a tag the clients draw from: one ledger for both.
            ledger = load.ledger.setdefault(f"segment:{ENRICH_TAG}", RangeSet())
            ledger.add(runs_of(sorted(enrichment.ids)))
        answering = await count_workers(control, wait=1.0)
        if answering < len(cluster.workers):
            # Alive but silent: each worker's stacks in its log say whether its loop is blocked, and where.
            cluster.dump_stacks()
            await asyncio.sleep(1.0)
    finally:
        with contextlib.suppress(Exception):
            await load.stop()
        with contextlib.suppress(Exception):
            await control.close()
    return phases, load, answering, enrichment


def run(options: SoakOptions) -> SoakReport:
    """Run the soak and return the judged report (also written to ``options.json_path`` if set).

    Raises:
        SoakError, DevServerError, FaketimeMissing: the soak could not run.
    """
    library = ensure_libfaketime(install=options.install)
    began = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    temporary = options.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="dispenser-soak-")) if options.workdir is None else options.workdir
    workdir = workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        workdir.chmod(0o755)  # PostgreSQL runs as its own user below it
    _say(options, f"profile {options.profile.name}, seed {options.seed}, files in {workdir}")
    cluster = SoakCluster(workdir, options.profile, library)
    statuses: dict[str, int | None] = {}
    alive: dict[str, bool] = {}
    report: SoakReport | None = None
    try:
        cluster.start_servers()
        _say(options, f"servers: {cluster.describe}")
        phases, load, answering, enrichment = run_async(_soak(options, cluster))
        alive = {name: not child.exited for name, child in cluster.workers.items()}
    finally:
        statuses = cluster.stop_all()
    workers: dict[str, Any] = {
        name: {
            "restarts": cluster.restarts[name],
            "alive_at_end": alive.get(name, False),
            "exit_status": statuses.get(name),
            "log": str(cluster.workers[name].log_path),
        }
        for name in WORKERS
    }
    report = SoakReport(
        profile=options.profile,
        seed=options.seed,
        phases=phases,
        ledger=load.ledger,
        problems=load.problems,
        workers=workers,
        meta={
            "date": date,
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()},
            "workdir": None if temporary else str(workdir),
            "workers_answering_at_end": answering,
            "enrichment": None if enrichment is None else enrichment.as_dict(),
            "enricher_restarts": cluster.enricher_restarts,
            "client_errors": dict(load.client_errors),
        },
    )
    judge(report)
    if enrichment is not None:
        report.failures.extend(enrichment.failures())
    report.meta["wall_s"] = round(time.monotonic() - began, 1)
    if temporary and report.passed:
        shutil.rmtree(workdir, ignore_errors=True)
    elif temporary:
        report.meta["workdir"] = str(workdir)  # kept: the logs say what went wrong
    if options.json_path is not None:
        write_json(options.json_path, report.as_dict())
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/soak",
        description=(
            "Soak test: real NATS, PostgreSQL and ZooKeeper (clustered, with Kafka, in the ha profiles), "
            "three worker processes, millions of IDs "
            "requested while faults are injected on a schedule; fails on any duplicate ID, malformed "
            "reply, or error reply that is not retryable. Prints a table per phase."
        ),
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="short",
        help="short (CI), long, ha-short (clustered servers, each failover once; CI) or ha (each twice)",
    )
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH", help="write the report here")
    parser.add_argument("--seed", type=int, default=1, help="seeds the clients' random requests (default 1)")
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="keep the servers' data and every log here (default: a temporary directory, removed if the run passes)",
    )
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="do not apt-get install faketime when libfaketime is missing",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every phase's duration and the ID target by this (e.g. 0.3 to try things out)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/soak [OPTIONS]``; returns the exit status (0 pass, 1 fail, 2 could not run)."""
    args = _parser().parse_args(argv)
    options = SoakOptions(
        profile=PROFILES[args.profile] if args.scale == 1.0 else scaled(PROFILES[args.profile], args.scale),
        seed=args.seed,
        json_path=args.json_path,
        workdir=args.workdir,
        install=not args.no_install,
        quiet=args.quiet,
    )
    # aiokafka logs every refused connection to a killed broker at WARNING, many a second: the soak's
    # Kafka requesters count what they see (timeouts, transport errors) per phase instead.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        report = run(options)
    except (SoakError, DevServerError, FaketimeMissing) as exc:
        print(f"scripts/soak: cannot run: {exc}", file=sys.stderr)
        return 2
    print(render(report), end="")
    if report.meta.get("workdir"):
        print(f"files: {report.meta['workdir']}")
    if options.json_path is not None:
        print(f"wrote {options.json_path}")
    return 0 if report.passed else 1
