"""The Kafka baseline responder: consume requests, produce each body back to its reply topic, nothing else.

``python -m dispenser_lab.bench.kafka_echo --bootstrap 127.0.0.1:9092 --topic bench.echo --group bench-echo``

The same consumer group, producer settings and Spring headers as the dispenser's request service
(:mod:`dispenser.adapters.kafka.requests`), minus the IDs: the ceiling a Python responder on aiokafka
reaches on this machine. Runs on uvloop until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from dispenser.adapters.kafka.connection import (
    CORRELATION_ID,
    REPLY_PARTITION,
    REPLY_TOPIC,
    decode_partition,
    header,
)

__all__ = ["main", "serve"]


async def serve(bootstrap: str, topic: str, group: str) -> None:
    """Echo every request of ``topic`` to its ``kafka_replyTopic`` until SIGTERM or SIGINT."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=0, retry_backoff_ms=10)
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=True,
        auto_offset_reset="earliest",
    )
    await producer.start()
    await consumer.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            fetched = await consumer.getmany(timeout_ms=200, max_records=500)
            for records in fetched.values():
                for record in records:
                    reply_topic = header(record.headers, REPLY_TOPIC)
                    if reply_topic is None:
                        continue
                    partition = header(record.headers, REPLY_PARTITION)
                    correlation = header(record.headers, CORRELATION_ID) or b""
                    await producer.send(
                        reply_topic.decode(),
                        record.value,
                        key=record.key,
                        partition=decode_partition(partition) if partition else None,
                        headers=[(CORRELATION_ID, correlation)],
                    )
    finally:
        await consumer.stop()
        await producer.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and serve."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.kafka_echo", description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    args = parser.parse_args(argv)
    from dispenser.runner import run_async  # noqa: PLC0415 - uvloop when present

    run_async(serve(args.bootstrap, args.topic, args.group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
