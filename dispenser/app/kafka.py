"""A worker over Kafka: the ID requests answered on the request topic."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from dispenser.adapters.kafka.requests import KafkaRequestService
from dispenser.config import Config
from dispenser.service.dispatch import Dispatcher

__all__ = ["start_kafka_service"]


async def start_kafka_service(
    stack: contextlib.AsyncExitStack,
    config: Config,
    dispatchers: Mapping[str, Dispatcher],
    on_created: Callable[[KafkaRequestService], None],
) -> KafkaRequestService:
    """Answer the ID requests on Kafka's request topic (``kafka.request_topic``).

    ``on_created`` gets the service before it starts (``/metrics`` counts its replies from then on).
    """
    kafka = config.kafka
    service = KafkaRequestService(
        kafka,
        dispatchers,
        max_body_bytes=config.limits.max_body_bytes,
        request_max_age=kafka.request_max_age,
        reply_timeout=kafka.reply_timeout,
    )
    on_created(service)
    # Registered before start(): the stack also closes the clients of a start that failed half-way.
    stack.push_async_callback(service.stop)
    await service.start()
    return service
