"""The residue-class exchange over NATS: claims announced, and checks answered, by every segment worker.

Announcements go to ``<prefix>.segment-residue``, checks to ``<prefix>.segment-residue-check``. A worker's message carries its database and its claims (:class:`~dispenser.messages.ResidueClaims`). A
check has a reply subject: every worker answers, with its claims if it is on another database. The rules:
:mod:`dispenser.service.residues`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from dispenser.adapters.nats.replies import gather_replies
from dispenser.core.residue import Residue
from dispenser.core.residue_claims import Database, ResidueClaim, ResidueState
from dispenser.messages import ResidueClaims, TagResidue
from dispenser.service.residues import ResidueGuard

__all__ = ["Heard", "announce", "ask_residues", "claims_of", "message_of", "serve_residues"]

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ResidueClaims)
_STATES: dict[str, ResidueState] = {"serving": "serving", "refused": "refused"}
_PUBLISH_TIMEOUT = 1.0
"""Seconds an announcement may wait for the connection (nats-py buffers while reconnecting)."""


def claims_of(message: ResidueClaims) -> list[ResidueClaim]:
    """The claims a peer's message makes (classes that do not parse are left out, and said)."""
    database = Database(message.system_identifier, message.database)
    claims = []
    for item in message.claims:
        try:
            residue = Residue(item.stride, item.offset)
        except ValueError as exc:
            log.warning("ignoring %s's claim on tag %r: %s", message.worker, item.tag, exc)
            continue
        state = _STATES.get(item.state, "serving")
        claims.append(
            ResidueClaim(item.tag, database, residue, message.worker, state, item.issued, message.datacenter)
        )
    return claims


def message_of(guard: ResidueGuard, claims: Iterable[ResidueClaim]) -> ResidueClaims:
    """This worker's message with ``claims``."""
    database = guard.database or Database("", "")
    return ResidueClaims(
        worker=guard.worker,
        datacenter=guard.datacenter,
        system_identifier=database.system_identifier,
        database=database.name,
        claims=[
            TagResidue(
                tag=c.tag, stride=c.residue.stride, offset=c.residue.offset, state=c.state, issued=c.issued
            )
            for c in claims
        ],
    )


async def announce(nc: Client, subject: str, guard: ResidueGuard, claims: list[ResidueClaim]) -> None:
    """Tell every live peer ``claims`` (best effort: NATS down costs the announcement, and a line)."""
    try:
        await asyncio.wait_for(
            nc.publish(subject, _encoder.encode(message_of(guard, claims))), _PUBLISH_TIMEOUT
        )
    except Exception as exc:  # a peer that missed it meets these claims at its next recheck
        log.warning(
            "could not announce residue claims on %s (the next recheck carries them): %r", subject, exc
        )


async def serve_residues(
    nc: Client, subject: str | None, check_subject: str | None, guard: ResidueGuard
) -> None:
    """Hear the peers' announcements on ``subject``, and answer their checks on ``check_subject`` (each if given).

    Plain subscriptions (every worker hears every message), ended by the connection's drain.
    """
    if subject is not None:
        await nc.subscribe(subject, cb=_hearer(subject, guard))
    if check_subject is not None:
        await nc.subscribe(check_subject, cb=_hearer(check_subject, guard, answer=True))


def _hearer(subject: str, guard: ResidueGuard, *, answer: bool = False) -> Callable[[Msg], Awaitable[None]]:
    async def hear(msg: Msg) -> None:
        try:
            message = _decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("ignoring a malformed residue message on %s", subject)
            return
        if message.worker == guard.worker:
            return  # our own announcement or check
        await guard.heard(claims_of(message))
        if not (answer and msg.reply):
            return
        own = guard.claims()
        database = guard.database
        same = database is not None and (message.system_identifier, message.database) == (
            database.system_identifier,
            database.name,
        )
        # Workers of one database share each tag's row: only another database's classes can clash. The
        # others answer too, without claims, so that the asker knows its check was heard.
        await msg.respond(_encoder.encode(message_of(guard, [] if same else own)))

    return hear


class Heard(msgspec.Struct):
    """What a check heard."""

    messages: list[ResidueClaims]
    answered: bool
    """Whether anything answered (a peer, or the server's "no responders": nobody listens); false means the
    check went unheard (no permission on the subject, or a slow server)."""

    @property
    def claims(self) -> list[ResidueClaim]:
        """Every claim the answers made."""
        return [claim for message in self.messages for claim in claims_of(message)]


async def ask_residues(nc: Client, subject: str, window: float, body: ResidueClaims) -> Heard:
    """Send a check with ``body`` and collect the answers that arrive within ``window`` seconds.

    Returns at once when the server answers "no responders" (no worker listens on the subject).
    """
    messages: list[ResidueClaims] = []

    def hear(msg: Msg) -> bool:
        try:
            messages.append(_decoder.decode(msg.data))
        except msgspec.DecodeError:
            log.warning("ignoring a malformed residue answer on %s", subject)
        return False

    answered = await gather_replies(nc, subject, _encoder.encode(body), window, hear)
    return Heard(messages, answered)
