"""The snowflake start-up clock check over NATS: every worker answers ``<prefix>.snowflake-clock``; a starting one asks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dispenser.core.peers import PeerReading
from dispenser.messages import ClockReading

__all__ = ["PeerClocks", "collect_peer_clocks", "serve_clock"]

log = logging.getLogger(__name__)

_clock_reply = msgspec.json.Encoder()


async def serve_clock(
    nc: Client, subject: str, wall_ms: Callable[[], int], worker_id: Callable[[], int]
) -> Subscription:
    """Answer peers' start-up clock checks on ``subject`` (every worker answers: no queue group)."""

    async def answer(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(_clock_reply.encode(ClockReading(wall_ms(), worker_id())))

    return await nc.subscribe(subject, cb=answer)


class PeerClocks(msgspec.Struct):
    """What the start-up clock query heard."""

    readings: list[PeerReading]
    answered: bool
    """Whether anything answered at all: a peer's reading, or the server's "no responders" status (no
    peer is running). False means the query went unheard: no permission to publish on the clock subject
    (or to receive on the inbox), or the server did not answer in time; the clock is then unverified."""


async def collect_peer_clocks(
    nc: Client, subject: str, wall_ms: Callable[[], int], window: float, enough: int | None = None
) -> PeerClocks:
    """Ask every live peer for its clock and collect the answers that arrive within ``window`` seconds.

    Args:
        nc: the connection.
        subject: the clock subject (``<prefix>.snowflake-clock``).
        wall_ms: our clock.
        window: seconds to listen for answers.
        enough: stop listening once this many peers have answered (``None``: the whole window).
    """
    inbox = nc.new_inbox()
    readings: list[PeerReading] = []
    answered = False
    subscription = await nc.subscribe(inbox)
    try:
        sent = wall_ms()
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        end = loop.time() + window
        while (left := end - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=left)
            except TimeoutError:
                break
            answered = True
            if not msg.data:
                continue  # the server's "no responders" status: nobody else is running
            try:
                reading = msgspec.json.decode(msg.data, type=ClockReading)
            except msgspec.DecodeError:
                log.warning("ignoring a malformed clock reading on %s", subject)
                continue
            readings.append(PeerReading(reading.wall_ms, sent, wall_ms(), reading.worker_id))
            if enough is not None and len(readings) >= enough:
                break
    finally:
        await subscription.unsubscribe()
    return PeerClocks(readings, answered)
