"""Benchmarks: commands that print a table and write JSON (``dispenser bench nats``), not timed tests.

One module per ``dispenser bench`` command, with its baseline responders; what each measures, how, and the
figures are in ``docs/benchmarks.md``. This package imports nothing heavy itself: ``python -m
dispenser_lab.bench.echo`` stays small.
"""

__all__ = [
    "client_bench",
    "echo",
    "kafka_bench",
    "kafka_echo",
    "nats_bench",
    "nats_load",
    "nats_plan",
    "nats_report",
    "ordered_bench",
    "permuted_inproc",
    "servers",
    "snowflake_inproc",
    "stats",
]
