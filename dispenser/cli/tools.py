"""The ``dispenser`` commands for developers: ``bench`` and ``schemas``.

The benchmarks (the lab's ``dispenser_lab.bench``, found through an entry point), and the JSON Schemas of the wire messages and the AsyncAPI document,
written or checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dispenser.cli.common import AddParser, lab_command
from dispenser.config import Config

__all__ = ["add_bench", "add_schemas", "run_bench", "run_schemas"]


def add_bench(add_parser: AddParser) -> None:
    """``dispenser bench TARGET``: the target's own options are passed on to it."""
    bench = add_parser(
        "bench",
        help=(
            "benchmark the service (`dispenser bench nats|kafka|snowflake|client|http|alternatives --help`; "
            "the lab's: pip install ./lab)"
        ),
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


def add_schemas(add_parser: AddParser) -> None:
    """``dispenser schemas``: where the files go, or ``--check`` that they match the code."""
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


def run_bench(args: argparse.Namespace, config: Config) -> int:
    """Run the chosen benchmark with its options: the benchmarks are the lab's (``leaf-dispenser-lab``)."""
    return lab_command("bench")(args, config)


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


def run_schemas(args: argparse.Namespace, _config: Config) -> int:
    """Write the schema files (or, with ``--check``, exit 1 if they differ from the code)."""
    from dispenser.asyncapi import asyncapi_document, to_yaml  # noqa: PLC0415
    from dispenser.messages import json_schemas  # noqa: PLC0415

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
            # The YAML too, as text: to_yaml writes it the same on every machine.
            if not path.exists() or path.read_text() != text:
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
