"""The commands that run a worker until a signal: ``dispenser serve`` and ``dispenser enrich``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from dispenser.adapters.kafka.enrich import Enricher, EnrichSettings
from dispenser.adapters.prometheus import EnricherCollector
from dispenser.app.parts import Off
from dispenser.app.stopping import STOP_BUDGET, Run, run_until_signal
from dispenser.app.worker import Worker
from dispenser.config import Config
from dispenser.core.errors import DispenserError
from dispenser.ports import IdSource

__all__ = ["run_enricher", "run_worker"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


async def run_worker(
    config: Config, on_ready: Callable[[Worker], None] | None = None, *, stop_budget: float = STOP_BUDGET
) -> int:
    """Run a worker until SIGTERM or SIGINT (``stop_budget`` seconds to wind down); returns the exit status."""

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        worker = Worker(config)
        await worker.start()  # releases what it opened if it fails
        stack.push_async_callback(worker.stop)
        if on_ready is not None:
            on_ready(worker)

        async def serve(stop: asyncio.Event) -> None:
            await stop.wait()
            log.info("shutting down: answering requests in flight")
            await worker.stop()
            log.info("stopped")

        return serve

    return await run_until_signal(start, stop_budget=stop_budget)


async def run_enricher(config: Config, settings: EnrichSettings) -> int:
    """Run ``dispenser enrich`` until SIGTERM or SIGINT; returns the exit status.

    Only the generator the stream uses is started (``settings.kind``), without serving requests.
    """
    segment = settings.kind == "segment"
    config = msgspec.structs.replace(
        config,
        segment=msgspec.structs.replace(config.segment, enabled=segment),
        snowflake=msgspec.structs.replace(config.snowflake, enabled=not segment),
        # Kafka is there by definition: the rate events go to its topic (requests are not served).
        kafka=msgspec.structs.replace(config.kafka, enabled=True),
    )

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        worker = Worker(config, serve=False)
        await worker.start()
        stack.push_async_callback(worker.stop)
        parts = worker.parts
        source: IdSource
        if not isinstance(parts.segments, Off):
            await parts.segments.allocator.resolve(settings.tag)  # an unknown tag is a start-up error
            source = parts.segments.allocator
        elif not isinstance(parts.snowflake, Off):
            source = parts.snowflake.generator
        else:  # not reachable: the config above turns exactly one generator on
            raise DispenserError(f"no {settings.kind} generator started")
        enricher = Enricher(config.kafka, settings, source)
        parts.registry.register(EnricherCollector(enricher, settings.input_topic))
        stack.push_async_callback(enricher.close)  # the enricher is closed before the worker stops
        await enricher.start()

        async def enrich(stop: asyncio.Event) -> None:
            await enricher.run(stop)
            stats = enricher.stats
            log.info(
                "stopped: %d records enriched, %d dead-lettered, %d transactions",
                stats.enriched,
                stats.dead_lettered,
                stats.transactions,
            )

        return enrich

    return await run_until_signal(start)
