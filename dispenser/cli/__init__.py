"""The ``dispenser`` command: serve IDs, run a development stack, administer tags, ask for IDs.

This module is the top of the command line: the global options, the parser that gathers every command
group's, and :func:`main`, which loads the configuration and runs the chosen command's handler. Each command
group keeps its parsers beside its handlers: ``serve`` (serve, enrich, dev), ``ask`` (get, watch, check,
decode), ``admin`` (migrate, tag, import-leaf), ``tools`` (bench, schemas) and ``settings`` (config);
``common`` holds what they share, ``logs`` the logging set-up.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dispenser import __version__
from dispenser.cli.admin import (
    add_import_leaf,
    add_migrate,
    add_tag,
    daily_of,
    ordered_of,
    residue_of,
    run_import_leaf,
    run_migrate,
    run_tag,
    set_policy,
)
from dispenser.cli.ask import (
    add_check,
    add_decode,
    add_get,
    add_watch,
    run_check,
    run_decode,
    run_get,
    run_watch,
)
from dispenser.cli.common import Handler
from dispenser.cli.logs import setup_logging
from dispenser.cli.serve import add_dev, add_enrich, add_serve, run_dev, run_enrich, run_serve
from dispenser.cli.settings import add_config, run_config
from dispenser.cli.tools import add_bench, add_schemas, run_bench, run_schemas
from dispenser.config import ConfigError, load_config, unknown_variables
from dispenser.core.errors import DispenserError

__all__ = ["main"]

log = logging.getLogger("dispenser")

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
    """The whole command line: the global options, then a subcommand each, in the order ``--help`` lists them."""
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
    add_serve(add_parser)
    add_enrich(add_parser)
    add_dev(add_parser)
    add_get(add_parser)
    add_watch(add_parser)
    add_check(add_parser)
    add_migrate(add_parser)
    add_config(add_parser)
    add_tag(add_parser, common)
    add_import_leaf(add_parser)
    add_bench(add_parser)
    add_decode(add_parser)
    add_schemas(add_parser)
    return parser


# The drivers the base install (the client) leaves out, and the extra that brings each (pyproject.toml).
_EXTRA_OF = {
    "aiohttp": "server",
    "aiomysql": "leaf-import",
    "aiokafka": "server",
    "asyncpg": "server",
    "Crypto": "server",  # pycryptodome: AES under permuted tags' FF3-1 (core/ff3_1.py)
    "kazoo": "server",
    "numpy": "server",  # permuted tags' batches (core/ff3_1.py)
    "prometheus_client": "server",
    "sqids": "server",
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
    setup_logging(config, args.verbose)
    if path == str(DEV_CONFIG):
        log.info("using the dev stack's settings from %s (give --config to use others)", DEV_CONFIG)
    for line in unknown_variables():
        log.warning("%s", line)
    try:
        _check_arguments(args)
    except DispenserError as exc:
        print(f"dispenser: {exc}", file=sys.stderr)
        return 2
    handlers: dict[str, Handler] = {
        "serve": run_serve,
        "enrich": run_enrich,
        "dev": run_dev,
        "get": run_get,
        "check": run_check,
        "watch": run_watch,
        "migrate": run_migrate,
        "tag": run_tag,
        "schemas": run_schemas,
        "bench": run_bench,
        "decode": run_decode,
        "config": run_config,
        "import-leaf": run_import_leaf,
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
            residue = residue_of(args)
            check_new_tag(
                args.tag, args.step, args.start, args.description, residue=residue, daily=daily_of(args)
            )
            ordered_of(args)
        elif args.tag_command == "set":
            if args.step is not None:
                check_step(args.step)
            set_policy(args)
