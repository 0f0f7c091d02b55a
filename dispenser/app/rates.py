"""A worker's rates: its book of meters and steps, its rate events published, its peers' heard."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from dispenser.adapters.kafka.rates import KafkaRateListener, KafkaRateSink
from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.rates import rate_sink, subscribe_rates
from dispenser.app.parts import Off, settings_of
from dispenser.app.segments import Segments
from dispenser.app.stopping import background
from dispenser.config import Config
from dispenser.core.step import StepPolicy
from dispenser.ports import Clock
from dispenser.service.rates import EventSink, RateBook, RatePublisher, RateSettings

__all__ = ["Rates", "rate_book", "start_rates"]


@dataclass(frozen=True, slots=True)
class Rates:
    """This worker's rate events going out, and its peers' coming in from Kafka."""

    publisher: RatePublisher
    listener: KafkaRateListener | Off
    """The peers' rate events from Kafka, when NATS (which carries them otherwise) is off."""


def rate_book(config: Config, clock: Clock) -> RateBook:
    """This worker's consumption rates, its peers', and the adaptive step (``[rate]``)."""
    return RateBook(
        clock,
        settings_of(RateSettings, config.rate),
        settings_of(StepPolicy, config.rate),
        datacenter=config.nats.datacenter,
    )


async def start_rates(
    stack: contextlib.AsyncExitStack,
    config: Config,
    book: RateBook,
    nc: Connection | Off,
    segments: Segments | Off,
) -> Rates:
    """Publish this worker's rate events (NATS; Kafka too when on), hear its peers' (NATS, or else Kafka)."""
    sinks: list[EventSink] = []
    listener: KafkaRateListener | Off = Off("kafka.enabled" if not config.kafka.enabled else "nats.enabled")
    if not isinstance(nc, Off):
        # The subscription ends with the connection's drain.
        await subscribe_rates(nc, config.nats.subject_prefix, book.observe)
        sinks.append(rate_sink(nc, config.nats.subject_prefix))
    if config.kafka.enabled:
        sink = KafkaRateSink(config.kafka, config.rate.kafka_topic)
        await sink.start()
        stack.push_async_callback(sink.close)
        sinks.append(sink)
        if isinstance(nc, Off):  # Kafka-only: hear the peers there (with NATS, its subscription does)
            listener = KafkaRateListener(config.kafka, config.rate.kafka_topic, book.observe)
            await listener.start()
            stack.push_async_callback(listener.close)
    allocator, store = (None, None) if isinstance(segments, Off) else (segments.allocator, segments.store)
    publisher = RatePublisher(book, allocator, sinks, peak_store=store)
    background(stack, publisher.run(), "rate-events")
    return Rates(publisher, listener)
