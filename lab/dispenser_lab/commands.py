"""The implementations of ``dispenser bench`` and ``dispenser dev``, found by the product's CLI.

The product parses the commands' arguments (their options are part of its ``--help``) and looks each
handler up by name in the ``dispenser.lab`` entry-point group (``lab/pyproject.toml``), so that it never
imports this package. Each handler imports what it runs only when asked: some start servers.
"""

from __future__ import annotations

import argparse
import sys

from dispenser.config import Config

__all__ = ["run_bench", "run_dev"]


def run_bench(args: argparse.Namespace, _config: Config) -> int:
    """Run the chosen benchmark (``args.target``) with its options (``args.options``)."""
    if args.target == "snowflake":
        from dispenser_lab.bench import snowflake_inproc  # noqa: PLC0415

        return snowflake_inproc.run_cli(args.options)
    if args.target == "client":
        from dispenser_lab.bench import client_bench  # noqa: PLC0415 - starts servers; only when asked

        return client_bench.main(args.options)
    if args.target == "http":
        from dispenser_lab.bench import http_bench  # noqa: PLC0415 - starts servers; only when asked

        return http_bench.main(args.options)
    if args.target == "alternatives":
        from dispenser_lab.bench import alternatives  # noqa: PLC0415 - starts servers; only when asked

        return alternatives.main(args.options)
    if args.target == "kafka":
        from dispenser_lab.bench import kafka_bench  # noqa: PLC0415 - starts servers; only when asked

        return kafka_bench.main(args.options)
    from dispenser_lab.bench import nats_bench  # noqa: PLC0415 - starts servers; only when asked

    return nats_bench.main(args.options)


def run_dev(args: argparse.Namespace, config: Config) -> int:
    """Run the development stack (``--ha``: the clustered one) until Ctrl-C."""
    from dispenser_lab.devstack import run_dev as run_stack  # noqa: PLC0415
    from dispenser_lab.servers import DevServerError  # noqa: PLC0415 - imports the server harness

    try:
        if args.ha:
            from dispenser_lab.devstack_ha import run_dev_ha  # noqa: PLC0415 - starts servers; only when asked

            return run_dev_ha(config, args.data_dir, kafka=args.kafka)
        return run_stack(
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
