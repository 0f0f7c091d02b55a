"""A worker over NATS: its connection (drained last of the serving parts), and the ID requests answered there."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

from dispenser.adapters.nats.connection import Connection, connect, drain
from dispenser.adapters.nats.service import NatsIdService, SpecialHandler
from dispenser.app.parts import Off
from dispenser.app.snowflake import Snowflake
from dispenser.config import Config
from dispenser.messages import id_subject
from dispenser.redaction import redact
from dispenser.service.dispatch import Dispatcher

__all__ = ["connect_nats", "start_nats_service"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


async def connect_nats(stack: contextlib.AsyncExitStack, config: Config) -> Connection:
    """Connect to NATS (trying for up to ``nats.start_deadline``); drained when the stack unwinds."""
    nc = await connect(config.nats, on_retry=_first_nats_failure(config))
    stack.push_async_callback(drain, nc)
    log.info("connected to NATS at %s", redact(config.nats.url))
    return nc


async def start_nats_service(
    stack: contextlib.AsyncExitStack,
    config: Config,
    nc: Connection,
    dispatchers: Mapping[str, Dispatcher],
    *,
    special: Mapping[str, Mapping[str, SpecialHandler]],
    snowflake: Snowflake | Off,
) -> NatsIdService:
    """Answer the ID requests on NATS, in the queue group (not the snowflake one once refused)."""
    service = NatsIdService(nc, config.nats, dispatchers, special_tags=special)
    if not isinstance(snowflake, Off):
        snowflake.on_leave(lambda: service.leave("snowflake"))
    stack.push_async_callback(service.stop)
    await service.start()
    log.info(
        "serving %s in queue group %r",
        ", ".join(id_subject(config.nats.subject_prefix, kind, "<tag>") for kind in dispatchers),
        config.nats.queue_group,
    )
    return service


def _first_nats_failure(config: Config) -> Callable[[Exception], None]:
    """Say once why NATS cannot be reached yet, and for how long the start keeps trying."""
    said = False

    def on_retry(exc: Exception) -> None:
        nonlocal said
        if not said:
            said = True
            log.warning(
                "cannot reach NATS at %s yet (%s): trying again for up to %g s (nats.start_deadline)",
                redact(config.nats.url),
                exc or type(exc).__name__,
                config.nats.start_deadline,
            )
        else:
            log.debug("NATS not reachable yet: %s", exc)

    return on_retry
