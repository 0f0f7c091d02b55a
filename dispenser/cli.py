"""The ``dispenser`` command: serve IDs, run a development stack, administer tags, ask for IDs."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from dispenser import __version__
from dispenser.arguments import non_negative_int, positive_float, positive_int
from dispenser.config import Config, ConfigError, effective, load_config, unknown_variables
from dispenser.core.errors import BadRequest, DispenserError, TagStartTooLow
from dispenser.core.residue import Residue
from dispenser.ports import SegmentStore, TagInfo
from dispenser.runner import run_async

__all__ = ["main"]

log = logging.getLogger("dispenser")

T = TypeVar("T")

LEAF_MYSQL_ENV = "LEAF_MYSQL_DSN"
"""Where ``dispenser import-leaf`` finds Leaf's database when ``--mysql`` is not given."""

EPILOG = """\
configuration:
  Settings come from defaults, then the TOML file (--config or DISPENSER_CONFIG), then environment
  variables DISPENSER_<SECTION>_<NAME>, e.g. DISPENSER_NATS_URL, DISPENSER_POSTGRES_DSN,
  DISPENSER_SNOWFLAKE_ENABLED, DISPENSER_SNOWFLAKE_MODE. See docs/configuration.md for every setting.

examples:
  dispenser dev                                  # NATS + PostgreSQL on this machine, serving tag 'demo'
  dispenser get demo 5                           # five IDs of tag 'demo'
  dispenser tag add order --step 10000           # a new tag (picked up by running workers)
  dispenser get --kind snowflake order 3         # snowflake IDs (snowflake.enabled = true)
  dispenser decode 2124065681627414617           # time, worker and sequence of a snowflake ID
  dispenser watch                                # every tag's rate, peak, step and runway, live
  DISPENSER_POSTGRES_DSN=postgresql://… dispenser serve
"""


class _JsonFormatter(logging.Formatter):
    """One JSON object per line (``log.format = "json"``), its ``time`` in RFC 3339, UTC, to the millisecond."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


_LOG_HANDLER = "dispenser-cli"
"""The name of the handler :func:`_setup_logging` installs (and replaces on a second call)."""


def _setup_logging(config: Config, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_LOG_HANDLER)
    if config.log.format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    # Replace our own handler only: one a host program (or a test harness) put on the root logger stays.
    for old in [h for h in root.handlers if h.get_name() == _LOG_HANDLER]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel("DEBUG" if verbose else config.log.level.upper())


DEV_CONFIG = Path(".dispenser") / "dev.toml"
"""What ``dispenser dev`` (with the default ``--data-dir``) writes for the commands of a second terminal."""
_OWN_CONFIG_COMMANDS = frozenset({"serve", "enrich", "dev"})
"""Commands that never pick up the dev stack's file by themselves: they run servers, not ask them."""


def _config_path(args: argparse.Namespace) -> str | None:
    """The configuration file: --config, DISPENSER_CONFIG, or the running dev stack's (``.dispenser/dev.toml``).

    The last only for commands that ask servers (get, watch, check, tag, …), run in the directory where
    ``dispenser dev`` (or ``scripts/dev``) runs: a second terminal then finds its ports without exports.
    """
    if args.config or os.environ.get("DISPENSER_CONFIG"):
        return str(args.config) if args.config else None
    if args.command not in _OWN_CONFIG_COMMANDS and DEV_CONFIG.is_file():
        return str(DEV_CONFIG)
    return None


def _global_options(*, suppress: bool) -> argparse.ArgumentParser:
    """-c and -v, accepted before the command and after it (``dispenser serve -c x.toml``).

    The copy on each subcommand has no defaults of its own (``SUPPRESS``), so that it never overwrites a
    value given before the command.
    """
    options = argparse.ArgumentParser(add_help=False)
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    options.add_argument(
        "-c",
        "--config",
        metavar="PATH",
        help="TOML configuration file (default: DISPENSER_CONFIG; see docs/configuration.md)",
        **default,
    )
    options.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level", **default)
    return options


def _parser() -> argparse.ArgumentParser:
    common = _global_options(suppress=True)
    parser = argparse.ArgumentParser(
        parents=[_global_options(suppress=False)],
        prog="dispenser",
        description=(
            "Leaf dispenser: unique 64-bit IDs over NATS and Kafka, from PostgreSQL segments (Leaf-segment) "
            "or snowflake generators with registered worker IDs (Leaf-snowflake)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = functools.partial(sub.add_parser, parents=[common])

    add_parser(
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
            "settings: every section; `dispenser config` prints the effective ones (docs/configuration.md)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

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

    dev = add_parser(
        "dev",
        help="start NATS and PostgreSQL (and Kafka with --kafka) locally, create tag 'demo', and serve (Ctrl-C stops everything)",
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

    get = add_parser(
        "get",
        help="ask the running service for IDs and print them, one per line",
        description="Ask a running worker for IDs (over NATS, or Kafka with --via kafka) and print them.",
    )
    get.add_argument("tag", help="the tag (segment: created with `dispenser tag add`; snowflake: any name)")
    get.add_argument("count", type=positive_int, nargs="?", default=1, help="how many IDs (default 1)")
    get.add_argument("--ranges", action="store_true", help="ask for ranges; print 'first last' per line")
    get.add_argument(
        "--kind", choices=["segment", "snowflake"], default="segment", help="generator (default segment)"
    )
    get.add_argument("--request-id", help="idempotency key: a retry returns the same IDs")
    get.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for the reply, connecting included (default 5)",
    )
    get.add_argument(
        "--via",
        choices=["nats", "kafka"],
        default="nats",
        help="ask over NATS (default) or the Kafka request topic",
    )

    watch = add_parser(
        "watch",
        help="live view of every tag's rate, peak, step, buffers and runway (from the rate events on NATS)",
    )
    watch.add_argument("--once", action="store_true", help="listen for one event interval, print one table")
    watch.add_argument("--json", action="store_true", help="print every rate event as a JSON line")
    watch.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        help="seconds to wait for NATS before giving up (default 5)",
    )

    add_parser(
        "check",
        help="check that every dependency can be reached; non-zero exit names failures",
        description=(
            "Try every dependency the configuration names (NATS, PostgreSQL and its schema, ZooKeeper or "
            "the snowflake registry, Kafka) and print one line each: ok, or FAIL with the cause. Exits 1 "
            "if any failed. Use it in a deployment's pre-flight, or to find out why a worker will not start."
        ),
    )
    migrate = add_parser(
        "migrate",
        help="create or upgrade the tables in PostgreSQL (idempotent)",
        description=(
            "Create leaf_alloc (Leaf's own table) and the dispenser's tables in postgres.dsn, or upgrade them "
            "to this version's schema. Safe to run again, and on a database Leaf already uses (existing "
            "rows are kept). Behind a long transaction it waits for a table lock at most --lock-timeout at a "
            "time (fetches queued behind it wait that long), rolls back and tries again until "
            "--lock-retry-for has passed, then exits 1 with nothing applied."
        ),
    )
    migrate.add_argument(
        "--lock-timeout",
        type=positive_float,
        help="seconds one attempt waits for a table lock (default 1)",
    )
    migrate.add_argument(
        "--lock-retry-for",
        type=positive_float,
        help="seconds of attempts before giving up (default 60)",
    )
    add_parser(
        "config",
        help="print the effective configuration (file, then DISPENSER_* variables) as TOML, secrets masked",
        description=(
            "Print the settings a command would run with: the defaults, overridden by the file (--config or "
            "DISPENSER_CONFIG), overridden by DISPENSER_* variables. Passwords, tokens and the password in "
            "a URL or DSN are masked; unset settings are left out."
        ),
    )

    tag = add_parser(
        "tag",
        help="administer segment tags",
        description="Create, list, change and remove segment tags (rows of leaf_alloc) in postgres.dsn.",
    )
    tag_sub = tag.add_subparsers(dest="tag_command", required=True, metavar="ACTION")
    add = tag_sub.add_parser("add", help="create a tag", parents=[common])
    add.add_argument("tag", help="the tag's name (letters, digits, - _ ., at most 128 characters)")
    add.add_argument("--step", type=positive_int, required=True, help="IDs per segment (at least 1)")
    add.add_argument(
        "--start",
        type=positive_int,
        default=1,
        help="first ID (default 1); refused below the high water of a removed tag of that name",
    )
    add.add_argument(
        "--resume",
        action="store_true",
        help="a tag removed before: start where it stopped (its high water), so its IDs never come back",
    )
    add.add_argument("--description", default="", help="free text")
    add.add_argument(
        "--stride",
        type=positive_int,
        default=1,
        help="a database per datacenter: hand out only IDs equal to --offset modulo this (the same in "
        "every datacenter; default 1, Leaf's tag). Set once: never change it",
    )
    add.add_argument(
        "--offset",
        type=int,
        default=None,
        help="this datacenter's residue, 0 to --stride - 1, different in each datacenter; required with "
        "--stride above 1 (a default would be the same in every datacenter)",
    )
    tag_sub.add_parser("list", help="list tags with their next ID and step", parents=[common])
    set_ = tag_sub.add_parser("set", help="change a tag's step (from its next segment)", parents=[common])
    set_.add_argument("tag", help="the tag's name")
    set_.add_argument("--step", type=positive_int, required=True, help="IDs per segment (at least 1)")
    remove = tag_sub.add_parser(
        "remove",
        help="delete a tag (its high water is kept: adding it again below is refused)",
        parents=[common],
    )
    remove.add_argument("tag", help="the tag's name")

    leaf = add_parser(
        "import-leaf",
        help="copy every tag from a Leaf MySQL database, each starting above anything Leaf can have granted",
        description=(
            "Copy Leaf's leaf_alloc tags into the dispenser's PostgreSQL (postgres.dsn), each starting at "
            "Leaf's max_id plus a margin. Stop every Leaf server first (docs/migrating-from-leaf.md). "
            "Safe to run again: a tag already at or above its safe start is left alone, none is lowered."
        ),
    )
    leaf.add_argument(
        "--mysql",
        metavar="DSN",
        help=f"Leaf's database, mysql://user:password@host:port/database (default: ${LEAF_MYSQL_ENV})",
    )
    leaf.add_argument(
        "--tags", metavar="A,B", help="only these tags (comma-separated; each must exist in Leaf)"
    )
    leaf.add_argument("--dry-run", action="store_true", help="print what would be done, write nothing")
    leaf.add_argument(
        "--force",
        action="store_true",
        help="raise tags the dispenser already has below their safe start (never lowers a tag)",
    )
    leaf.add_argument(
        "--margin",
        type=non_negative_int,
        metavar="N",
        help="IDs to start above Leaf's max_id (default: max(step, 1000000), one largest Leaf segment)",
    )

    bench = add_parser(
        "bench",
        help="benchmark the service (`dispenser bench nats|kafka|snowflake|client|http|alternatives --help`)",
    )
    bench.add_argument(
        "target",
        choices=["nats", "kafka", "snowflake", "client", "http", "alternatives"],
        help=(
            "nats: the worker against an echo responder; kafka: request/reply against a Kafka echo responder "
            "and enrichment against a plain transactional copy loop; snowflake: in-process IDs/s against "
            "the format's ceiling; client: the buffered client's next_id and take against a request per ID; "
            "http: Leaf's HTTP API against a trivial aiohttp handler (needs wrk); alternatives: the client "
            "beside a PostgreSQL sequence, UUIDv7, ULID and an embedded snowflake (docs/why.md)"
        ),
    )
    bench.add_argument("options", nargs=argparse.REMAINDER, help="options of the benchmark")

    decode = add_parser(
        "decode",
        help="take a snowflake ID apart (time, datacenter, worker, sequence) with the configured layout",
    )
    decode.add_argument("id", type=int, help="a snowflake ID, in decimal")

    schemas = add_parser(
        "schemas", help="write (or check) the JSON Schemas of the wire messages and the AsyncAPI document"
    )
    # Defaults are None: without a path, the command writes into the checkout it runs in, and refuses to
    # run outside one (an installed wheel has no schemas/ or docs/ of its own to keep up to date).
    schemas.add_argument(
        "--dir", type=Path, help="where the JSON Schemas go (default: schemas/ of the checkout)"
    )
    schemas.add_argument(
        "--asyncapi",
        type=Path,
        help="the AsyncAPI 3.0 document of every subject and topic (default: docs/asyncapi.yaml of the checkout)",
    )
    schemas.add_argument("--check", action="store_true", help="exit 1 if the files differ from the code")
    return parser


# The drivers the base install (the client) leaves out, and the extra that brings each (pyproject.toml).
_EXTRA_OF = {
    "aiohttp": "server",
    "aiomysql": "leaf-import",
    "aiokafka": "server",
    "asyncpg": "server",
    "kazoo": "server",
    "prometheus_client": "server",
    "uvloop": "server",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (tests call this without a subprocess)."""
    args = _parser().parse_args(argv)
    path = _config_path(args)
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"dispenser: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config, args.verbose)
    if path == str(DEV_CONFIG):
        log.info("using the dev stack's settings from %s (give --config to use others)", DEV_CONFIG)
    for line in unknown_variables():
        log.warning("%s", line)
    try:
        _check_arguments(args)
    except DispenserError as exc:
        print(f"dispenser: {exc}", file=sys.stderr)
        return 2
    handlers: dict[str, Callable[[argparse.Namespace, Config], int]] = {
        "serve": _serve,
        "enrich": _enrich,
        "dev": _dev,
        "get": _get,
        "check": _check,
        "watch": _watch,
        "migrate": _migrate,
        "tag": _tag,
        "schemas": _schemas,
        "bench": _bench,
        "decode": _decode,
        "config": _config,
        "import-leaf": _import_leaf,
    }
    try:
        return handlers[args.command](args, config)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as missing:
        module = (missing.name or "").split(".")[0]
        extra = _EXTRA_OF.get(module)
        if extra is None:
            raise
        if args.command == "get" and module == "aiokafka":  # a client over Kafka needs no worker
            extra = "kafka"
        if args.command == "import-leaf":  # the MySQL driver and PostgreSQL's, in one extra
            extra = "leaf-import"
        # A client-only install (pip install leaf-dispenser) has no worker drivers: say what to install.
        print(
            f"dispenser {args.command}: {missing.name} is not installed (it comes with the [{extra}] "
            f"extra): pip install 'leaf-dispenser[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except (DispenserError, OSError) as exc:
        print(f"dispenser: {exc}", file=sys.stderr)
        return 1


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments the server would refuse, before connecting to anything (BadRequest, InvalidTag)."""
    from dispenser.core.store_rules import check_new_tag, check_step  # noqa: PLC0415
    from dispenser.core.tags import validate_tag  # noqa: PLC0415

    if args.command == "get":
        validate_tag(args.tag)
    elif args.command == "tag" and args.tag_command != "list":
        validate_tag(args.tag)
        if args.tag_command == "add":
            check_new_tag(args.tag, args.step, args.start, args.description)
            _residue(args)
        elif args.tag_command == "set":
            check_step(args.step)


def _config(_args: argparse.Namespace, config: Config) -> int:
    import tomli_w  # noqa: PLC0415

    def present(values: dict[str, Any]) -> dict[str, Any]:  # TOML has no null: unset settings are left out
        return {name: value for name, value in values.items() if value is not None}

    sections = {section: present(values) for section, values in effective(config).items()}
    sys.stdout.write(tomli_w.dumps(sections))
    return 0


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack to stderr, and the process goes on.

    For a worker that is alive but silent: the main thread's stack shows whether the event loop is
    blocked (and where) or idle, waiting for something that does not come.
    """
    if not hasattr(signal, "SIGUSR1"):  # Windows
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr is no file (embedded, or a test capturing it)
        log.debug("no stacks on SIGUSR1: stderr has no file descriptor")


def _uvloop_suits(config: Config) -> bool:
    """Whether to run on uvloop: not with TLS to Kafka, whose connections it closes in 30 s (``run_async``)."""
    return config.kafka.security_protocol not in ("SSL", "SASL_SSL")


def _serve(_args: argparse.Namespace, config: Config) -> int:
    from dispenser.app import run_worker  # noqa: PLC0415 - keep `dispenser get` light

    _stacks_on_sigusr1()
    return run_async(run_worker(config), fast=_uvloop_suits(config))


def _enrich(args: argparse.Namespace, config: Config) -> int:
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
    _stacks_on_sigusr1()
    return run_async(run_enricher(config, settings), fast=_uvloop_suits(config))


def _dev(args: argparse.Namespace, config: Config) -> int:
    from dispenser.devstack import run_dev  # noqa: PLC0415
    from dispenser.testing.servers import DevServerError  # noqa: PLC0415 - imports the server harness

    try:
        if args.ha:
            from dispenser.devstack_ha import run_dev_ha  # noqa: PLC0415 - starts servers; only when asked

            return run_dev_ha(config, args.data_dir, kafka=args.kafka)
        return run_dev(
            config,
            args.data_dir,
            nats_port=args.nats_port,
            postgres_port=args.postgres_port,
            kafka_port=args.kafka_port,
            kafka=args.kafka,
            datacenters=args.datacenters,
        )
    except (DevServerError, ValueError) as exc:
        print(f"dispenser dev: {exc}", file=sys.stderr)
        return 1


def _get(args: argparse.Namespace, config: Config) -> int:
    from dispenser.adapters.nats.client import request_once  # noqa: PLC0415
    from dispenser.messages import Reply, id_subject  # noqa: PLC0415

    body: dict[str, Any] = {"count": args.count}
    if args.ranges:
        body["format"] = "ranges"
    if args.request_id:
        body["request_id"] = args.request_id
    subject = id_subject(config.nats.subject_prefix, args.kind, args.tag)

    async def ask_kafka() -> Reply:
        from dispenser.client import KafkaIdClient  # noqa: PLC0415 - imports aiokafka

        async with KafkaIdClient(config.kafka, timeout=args.timeout) as client:
            try:
                return await client.request(
                    args.tag,
                    args.count,
                    kind=args.kind,
                    format="ranges" if args.ranges else "ids",
                    request_id=args.request_id,
                )
            except TimeoutError:
                raise OSError(
                    f"no reply on {config.kafka.reply_topic!r} within {args.timeout}s (is a worker serving "
                    f"{config.kafka.request_topic!r} on {config.kafka.bootstrap_servers}?)"
                ) from None

    async def ask() -> Reply:
        data = await request_once(
            config.nats, subject, msgspec.json.encode(body), args.timeout, "dispenser-get"
        )
        return msgspec.json.decode(data, type=Reply)

    reply = run_async(ask_kafka() if args.via == "kafka" else ask(), fast=_uvloop_suits(config))
    if reply.error is not None:
        retry = " (retryable)" if reply.error.retryable else ""
        print(f"dispenser: {reply.error.code}: {reply.error.message}{retry}", file=sys.stderr)
        return 1
    out = sys.stdout
    if reply.ranges is not None:
        out.writelines(f"{first} {last}\n" for first, last in reply.ranges)
    elif reply.ids is not None:
        out.writelines(f"{i}\n" for i in reply.ids)
    return 0


def _watch(args: argparse.Namespace, config: Config) -> int:
    from dispenser.watch import run_watch  # noqa: PLC0415

    return run_async(run_watch(config, once=args.once, as_json=args.json, timeout=args.timeout))


def _check(_args: argparse.Namespace, config: Config) -> int:
    from dispenser.health import check_all  # noqa: PLC0415

    results = run_async(check_all(config), fast=_uvloop_suits(config))
    failed = [r for r in results if not r.ok]
    for result in results:
        print(f"{'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
        if result.warning:
            print(f"WARN {result.name}: {result.warning}")
    if failed:
        print(f"dispenser: cannot reach {', '.join(r.name for r in failed)}", file=sys.stderr)
        return 1
    return 0


def _with_store(config: Config, action: Callable[[Any], Awaitable[T]]) -> T:
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async def go() -> T:
        async with await PostgresSegmentStore.connect(config.postgres.dsn, command_timeout=10.0) as store:
            return await action(store)

    return run_async(go())


def _migrate(args: argparse.Namespace, config: Config) -> int:
    from dispenser.adapters.postgres.schema import migrate  # noqa: PLC0415

    # Unset: the defaults of migrate() (the schema module imports asyncpg, so it is not imported up here).
    limits = {name: getattr(args, name) for name in ("lock_timeout", "lock_retry_for") if getattr(args, name)}
    applied = run_async(migrate(config.postgres.dsn, **limits))
    if applied:
        print(f"applied schema version(s) {', '.join(map(str, applied))}")
    else:
        print("schema is up to date")
    return 0


def _tag(args: argparse.Namespace, config: Config) -> int:
    if args.tag_command == "list":
        infos = _with_store(config, lambda store: store.list_tags())
        print(f"{'TAG':<32} {'NEXT ID':>20} {'STEP':>10}  DESCRIPTION")
        for info in infos:
            print(f"{info.tag:<32} {info.max_id:>20} {info.step:>10}  {info.description}")
        return 0
    if args.tag_command == "add":
        info = _with_store(config, lambda store: _add_tag(store, args))
        print(f"added tag {info.tag!r}: first ID {info.max_id}, step {info.step}")
    elif args.tag_command == "set":
        info = _with_store(config, lambda store: store.set_step(args.tag, args.step))
        print(f"tag {info.tag!r}: step is now {info.step} (from its next segment)")
    else:
        _with_store(config, lambda store: store.remove_tag(args.tag))
        print(f"removed tag {args.tag!r}")
    return 0


def _import_leaf(args: argparse.Namespace, config: Config) -> int:
    from dispenser.leaf_import import import_leaf  # noqa: PLC0415 - imports the MySQL driver

    # The DSN holds a password: from the environment it stays out of `ps` and the shell's history.
    dsn = args.mysql or os.environ.get(LEAF_MYSQL_ENV)
    if not dsn:
        print(
            f"dispenser import-leaf: give Leaf's database with --mysql DSN or ${LEAF_MYSQL_ENV}",
            file=sys.stderr,
        )
        return 2
    tags = None if args.tags is None else [t.strip() for t in args.tags.split(",") if t.strip()]
    if tags is not None and not tags:
        print("dispenser import-leaf: --tags names no tag", file=sys.stderr)
        return 2
    try:
        report = run_async(
            import_leaf(
                dsn,
                config.postgres.dsn,
                tags=tags,
                margin=args.margin,
                force=args.force,
                dry_run=args.dry_run,
            )
        )
    except ValueError as exc:
        print(f"dispenser import-leaf: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # the leaf-import extra is missing
        print(f"dispenser import-leaf: {exc}", file=sys.stderr)
        return 1
    for warning in report.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    print("\n".join(report.lines()))
    if report.failed:
        print(
            f"dispenser import-leaf: {len(report.failed)} tag(s) not imported: "
            f"{', '.join(p.row.tag for p in report.failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _residue(args: argparse.Namespace) -> Residue:
    """``--stride`` and ``--offset`` as a residue class (BadRequest when they do not make one).

    ``--offset`` has no default with a stride: the same command run in two datacenters would give both
    offset 0, and every ID would be handed out twice (docs/datacenters.md).
    """
    if args.offset is None and args.stride > 1:
        raise BadRequest(
            f"--offset is required with --stride {args.stride}: give each datacenter's database its own "
            f"offset, 0 to {args.stride - 1} (the same offset in two databases hands out every ID twice)"
        )
    try:
        return Residue(args.stride, args.offset or 0)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


async def _add_tag(store: SegmentStore, args: argparse.Namespace) -> TagInfo:
    """``tag add``: with ``--resume``, a removed tag starts at its high water (or ``--start``, if higher)."""
    residue = _residue(args)
    try:
        return await store.add_tag(args.tag, args.step, args.start, args.description, residue=residue)
    except TagStartTooLow as exc:
        if not args.resume:
            raise
        return await store.add_tag(args.tag, args.step, exc.high_water, args.description, residue=residue)


def _bench(args: argparse.Namespace, _config: Config) -> int:
    if args.target == "snowflake":
        from dispenser.bench import snowflake_inproc  # noqa: PLC0415

        return snowflake_inproc.run_cli(args.options)
    if args.target == "client":
        from dispenser.bench import client_bench  # noqa: PLC0415 - starts servers; only when asked

        return client_bench.main(args.options)
    if args.target == "http":
        from dispenser.bench import http_bench  # noqa: PLC0415 - starts servers; only when asked

        return http_bench.main(args.options)
    if args.target == "alternatives":
        from dispenser.bench import alternatives  # noqa: PLC0415 - starts servers; only when asked

        return alternatives.main(args.options)
    if args.target == "kafka":
        from dispenser.bench import kafka_bench  # noqa: PLC0415 - starts servers; only when asked

        return kafka_bench.main(args.options)
    from dispenser.bench import nats_bench  # noqa: PLC0415 - starts servers; only when asked

    return nats_bench.main(args.options)


def _decode(args: argparse.Namespace, config: Config) -> int:
    from dispenser.registries import layout_of  # noqa: PLC0415
    from dispenser.service.decode import decode_id  # noqa: PLC0415

    reply = decode_id(layout_of(config.snowflake), args.id)
    print(f"id:        {reply.id}")
    print(f"time:      {reply.time}  ({reply.timestamp_ms} ms since 1970)")
    if reply.datacenter_id is not None:
        print(f"datacenter: {reply.datacenter_id}")
    print(f"worker:    {reply.worker_id}")
    print(f"sequence:  {reply.sequence}")
    return 0


def _checkout(start: Path) -> Path | None:
    """The leaf-dispenser source checkout holding ``start`` (its pyproject.toml's directory), if any."""
    for directory in (start, *start.parents):
        project = directory / "pyproject.toml"
        if (
            (directory / "dispenser" / "messages.py").is_file()
            and project.is_file()
            and 'name = "leaf-dispenser"' in project.read_text(encoding="utf-8")
        ):
            return directory
    return None


def _schemas(args: argparse.Namespace, _config: Config) -> int:
    from dispenser.messages import json_schemas  # noqa: PLC0415

    try:
        import yaml  # noqa: F401, PLC0415 - asked for here, so that a missing one is said in one line

        from dispenser.asyncapi import asyncapi_document, is_current, to_yaml  # noqa: PLC0415
    except ImportError as missing:
        print(
            f"dispenser: `dispenser schemas` is a developer's command and needs {missing.name}: "
            "pip install -e '.[test]' in a checkout",
            file=sys.stderr,
        )
        return 2
    directory: Path | None = args.dir
    document: Path | None = args.asyncapi
    if directory is None or document is None:
        root = _checkout(Path.cwd())
        if root is None:
            print(
                "dispenser: `dispenser schemas` writes schemas/ and docs/asyncapi.yaml of a leaf-dispenser "
                "checkout, and this is none (run it inside one, or give both --dir and --asyncapi)",
                file=sys.stderr,
            )
            return 2
        directory = directory or root / "schemas"
        document = document or root / "docs" / "asyncapi.yaml"
    files = {
        directory / name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }
    # The defaults, not the running configuration: the document is the one in the repository's docs.
    files[document] = to_yaml(asyncapi_document())
    drift = []
    for path, text in files.items():
        if args.check:
            if not path.exists():
                drift.append(str(path))
            elif path == document:
                # Compared as data: another PyYAML release may lay out the same document differently.
                if not is_current(path.read_text(encoding="utf-8")):
                    drift.append(str(path))
            elif path.read_text() != text:
                drift.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if drift:
        print(f"dispenser: schemas differ from the code: {', '.join(drift)}", file=sys.stderr)
        print("run `dispenser schemas` to regenerate them", file=sys.stderr)
        return 1
    return 0
