"""Rate events over NATS: each worker publishes ``<prefix>.rate.<tag>``; peers and ``dispenser watch`` listen."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dispenser.adapters.nats.connection import connect
from dispenser.config import NatsConfig
from dispenser.messages import RateEvent, rate_subject

__all__ = ["listening_to_rates", "rate_sink", "subscribe_rates"]

log = logging.getLogger(__name__)

_rate_events = msgspec.json.Decoder(RateEvent)


def rate_sink(nc: Client, prefix: str) -> Callable[[RateEvent], Awaitable[None]]:
    """Publish rate events on ``<prefix>.rate.<tag>``."""

    async def publish(event: RateEvent) -> None:
        await nc.publish(rate_subject(prefix, event.tag), msgspec.json.encode(event))

    return publish


async def subscribe_rates(nc: Client, prefix: str, observe: Callable[[RateEvent], None]) -> Subscription:
    """Hand every rate event on ``<prefix>.rate.>`` to ``observe`` (malformed ones are logged and dropped)."""

    async def received(msg: Msg) -> None:
        try:
            event = _rate_events.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("ignoring a malformed rate event on %s: %s", msg.subject, exc)
            return
        observe(event)

    return await nc.subscribe(rate_subject(prefix, ">"), cb=received)


@contextlib.asynccontextmanager
async def listening_to_rates(
    config: NatsConfig,
    observe: Callable[[RateEvent], None],
    name: str = "dispenser-watch",
    *,
    deadline: float | None = None,
) -> AsyncIterator[None]:
    """Connect and hand every rate event of the fleet to ``observe`` until the block ends (``dispenser watch``).

    Raises:
        OSError: NATS cannot be reached within ``deadline`` seconds (default ``config.start_deadline``).
    """
    nc = await connect(config, name=name, deadline=deadline)
    try:
        await subscribe_rates(nc, config.subject_prefix, observe)
        yield
    finally:
        await nc.close()
