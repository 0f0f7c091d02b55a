"""Benchmarks: commands that print a table and write JSON (``dispenser bench nats``), not timed tests.

* :mod:`dispenser.bench.nats_bench`: the dispenser worker against a trivial echo responder over one NATS
  server; throughput at 1 and 64 requests in flight, latency percentiles, and segment switch-overs. Its
  parts: :mod:`~dispenser.bench.nats_plan` (options and what to measure), :mod:`~dispenser.bench.nats_load`
  (child processes and the load generator) and :mod:`~dispenser.bench.nats_report` (targets and the table).
* :mod:`dispenser.bench.kafka_bench`: the same comparison over Kafka, against :mod:`dispenser.bench.kafka_echo`.
* :mod:`dispenser.bench.echo`: the baseline responder, run in a process of its own.
* :mod:`dispenser.bench.stats`: percentiles, the case records and the text table.
* :mod:`dispenser.bench.snowflake_inproc`: ``dispenser bench snowflake``, in-process IDs/s of the snowflake
  generator against the format's ceiling.

This package imports nothing heavy itself: ``python -m dispenser.bench.echo`` stays small.
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
    "servers",
    "snowflake_inproc",
    "stats",
]
