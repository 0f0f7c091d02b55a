"""The snowflake peer checks over NATS: every worker answers ``<prefix>.snowflake-clock``; a checking one asks.

An answer carries the worker's clock and its claim on its ID; a worker's own check carries its claim too
(an empty body: an observer, such as ``dispenser check``), so the answering workers hear it as well.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dispenser.adapters.nats.replies import gather_replies
from dispenser.core.node_bits import NodeBits
from dispenser.core.peers import Claim, ClaimState, PeerReading
from dispenser.messages import ClockReading
from dispenser.service.identity import IdentityGuard

__all__ = ["PeerClocks", "claim_of", "collect_peer_clocks", "join_peers", "reading_of", "serve_clock"]

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ClockReading)
_STATES: dict[str, ClaimState] = {"starting": "starting", "serving": "serving", "refused": "refused"}


def claim_of(reading: ClockReading) -> Claim:
    """The claim a peer's message makes (an older worker's: datacenter 0, no nonce, no node bits, serving)."""
    state = _STATES.get(reading.state, "")
    return Claim(
        reading.datacenter_id, reading.worker_id, reading.nonce, state, reading.address, _bits_of(reading)
    )


def _bits_of(reading: ClockReading) -> NodeBits | None:
    shift, width, value, id_bits, epoch_ms = (
        reading.node_shift,
        reading.node_width,
        reading.node_value,
        reading.id_bits,
        reading.epoch_ms,
    )
    if shift is None or width is None or value is None or id_bits is None or epoch_ms is None:
        return None  # a worker older than the node bits (they come all together)
    return NodeBits(shift=shift, width=width, value=value, id_bits=id_bits, epoch_ms=epoch_ms)


def reading_of(wall_ms: int, claim: Claim) -> ClockReading:
    """This worker's message: its clock and its claim."""
    bits = claim.bits
    return ClockReading(
        wall_ms,
        claim.worker_id,
        claim.datacenter_id,
        claim.nonce,
        claim.state or "serving",
        claim.address,
        node_shift=None if bits is None else bits.shift,
        node_width=None if bits is None else bits.width,
        node_value=None if bits is None else bits.value,
        id_bits=None if bits is None else bits.id_bits,
        epoch_ms=None if bits is None else bits.epoch_ms,
    )


async def serve_clock(
    nc: Client,
    subject: str,
    wall_ms: Callable[[], int],
    claim: Callable[[], Claim],
    on_claim: Callable[[Claim], None] | None = None,
) -> Subscription:
    """Answer peers' checks on ``subject`` with our clock and claim (every worker answers: no queue group).

    ``on_claim`` hears the claim a checking peer sends along (not an observer's empty check), before the
    answer goes out.
    """

    async def answer(msg: Msg) -> None:
        if msg.data and on_claim is not None:
            try:
                on_claim(claim_of(_decoder.decode(msg.data)))
            except msgspec.DecodeError:
                log.warning("ignoring a malformed peer check on %s", subject)
        if msg.reply:
            await msg.respond(_encoder.encode(reading_of(wall_ms(), claim())))

    subscription = await nc.subscribe(subject, cb=answer)
    # nats-py only buffers the SUB: the round trip makes the server hold it before we go on, so "subscribed"
    # means what join_peers' argument needs (our server knows the answerer, and tells its routes/gateways).
    await nc.flush()
    return subscription


class PeerClocks(msgspec.Struct):
    """What the clock query heard."""

    readings: list[PeerReading]
    answered: bool
    """Whether anything answered at all: a peer's reading, or the server's "no responders" status (no
    peer is running). False means the query went unheard: no permission to publish on the clock subject
    (or to receive on the inbox), or the server did not answer in time; the clock is then unverified."""

    @property
    def claims(self) -> list[Claim]:
        """The claims the answers made."""
        return [r.claim for r in self.readings if r.claim is not None]


async def collect_peer_clocks(
    nc: Client,
    subject: str,
    wall_ms: Callable[[], int],
    window: float,
    enough: int | None = None,
    *,
    claim: Claim | None = None,
) -> PeerClocks:
    """Ask every live peer for its clock and collect the answers that arrive within ``window`` seconds.

    Returns at once when the server answers "no responders" (nobody listens on the subject).

    Args:
        nc: the connection.
        subject: the clock subject (``<prefix>.snowflake-clock``).
        wall_ms: our clock.
        window: seconds to listen for answers.
        enough: stop listening once this many peers have answered (``None``: the whole window).
        claim: ours, sent along so that the peers hear it (None: ask as an observer).
    """
    readings: list[PeerReading] = []
    sent = wall_ms()
    body = b"" if claim is None else _encoder.encode(reading_of(sent, claim))

    def hear(msg: Msg) -> bool:
        try:
            reading = _decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("ignoring a malformed clock reading on %s", subject)
            return False
        if claim is not None and reading.nonce == claim.nonce:
            return False  # our own answer (the worker answers its own subject too)
        readings.append(PeerReading(reading.wall_ms, sent, wall_ms(), reading.worker_id, claim_of(reading)))
        return enough is not None and len(readings) >= enough

    answered = await gather_replies(nc, subject, body, window, hear)
    return PeerClocks(readings, answered)


async def join_peers(
    nc: Client, subject: str, wall_ms: Callable[[], int], window: float, guard: IdentityGuard
) -> tuple[Subscription, PeerClocks]:
    """Start answering on ``subject``, check the live peers twice, and serve unless ``guard`` refused.

    Of two workers on one ID started at the same instant, at most one serves if the NATS servers make a
    subscription known to each other within ``window`` and a check's answer comes back within ``window``
    (docs/snowflake.md, "Two workers on one ID"). The first check goes out at once (a serving rival is
    heard without delay); the second no earlier than ``window`` after our answerer was in place, so that
    when it goes out the answerer of a rival that subscribed before us is known to our server, and the
    rival hears this check (and refuses, or answers as serving and this worker refuses). Interest crosses
    routes and gateways asynchronously: with one check only, both workers served in 12 and 26 of 120
    simultaneous starts across a gateway and a cluster (``tests/integration/test_snowflake_simultaneous.py``).

    Returns:
        The answerer's subscription (it answers until unsubscribed) and what the last check heard.
    """
    loop = asyncio.get_running_loop()
    answerer = await serve_clock(nc, subject, wall_ms, guard.claim, guard.hear)
    subscribed = loop.time()
    heard = await collect_peer_clocks(nc, subject, wall_ms, window, claim=guard.claim())
    answered = heard.answered
    if guard.heard(heard.claims) is None:
        await asyncio.sleep(max(0.0, subscribed + window - loop.time()))
        heard = await collect_peer_clocks(nc, subject, wall_ms, window, claim=guard.claim())
        answered = answered or heard.answered
        guard.heard(heard.claims)
    guard.started()
    return answerer, PeerClocks(heard.readings, answered)
