"""The guard against two databases serving one tag in residue classes that share IDs.

Segment workers tell each other, over the broker, the class each tag has in their database when they start
serving it. No broker here: the wiring passes heard claims in (:meth:`ResidueGuard.heard`) and sends what
:meth:`ResidueGuard.claim` announces. The rules, and the window in which they cannot hold:
``docs/datacenters.md`` ("Two databases, one class").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Iterable

from dispenser.core.errors import ResidueOverlap
from dispenser.core.residue import Residue
from dispenser.core.residue_claims import Database, ResidueClaim, overlaps, rivals

__all__ = ["ResidueGuard"]

log = logging.getLogger(__name__)

Announce = Callable[[list[ResidueClaim]], Awaitable[None]]
"""Tell every live peer these claims of this worker (best effort: the wiring logs a failure)."""


class ResidueGuard:
    """This worker's claims on its tags' classes, the peers' claims it heard, and its verdict on them.

    A worker claims a tag's class at the tag's first segment, before handing out any of its IDs
    (:meth:`claim`): it refuses when it knows a live claim of another database on that tag whose class
    intersects. A serving worker that hears such a claim from a worker that served too (both started
    unheard by each other) refuses as well; one that hears a worker refused before serving only warns.

    Args:
        worker: this worker's name, as in its rate events.
        database: reads this worker's database identity (called until it answers once).
        announce: sends this worker's claims to the peers.
        datacenter: ``nats.datacenter``, named in the messages.
        on_refuse: called with (tag, error) when a tag already served must stop (a later refusal).
    """

    def __init__(
        self,
        worker: str,
        database: Callable[[], Awaitable[Database]],
        announce: Announce,
        *,
        datacenter: str = "",
        on_refuse: Callable[[str, ResidueOverlap], None] | None = None,
    ) -> None:
        self.worker = worker
        self.datacenter = datacenter
        self.database: Database | None = None
        """This worker's database, once read."""
        self.on_refuse = on_refuse
        self._read_database = database
        self._announce = announce
        self._own: dict[str, ResidueClaim] = {}
        self._refusals: dict[str, ResidueOverlap] = {}
        # The peers' claims by (worker, tag), with the round in which each was last heard: a recheck
        # forgets the workers that did not answer it (stopped, or no longer claiming).
        self._peers: dict[tuple[str, str], tuple[ResidueClaim, int]] = {}
        self._round = 0
        self._warned: set[tuple[str, str]] = set()

    # -- this worker's claims ----------------------------------------------------------------------

    async def read_database(self) -> Database:
        """This worker's database (read once; raises what ``database`` raises until it answers)."""
        if self.database is None:
            self.database = await self._read_database()
        return self.database

    async def claim(self, tag: str, residue: Residue) -> None:
        """Claim ``tag``'s class before serving it; refuse if another database serves an intersecting one.

        Raises:
            ResidueOverlap: a live claim of another database on ``tag`` intersects ``residue``.
            StoreUnavailable: the database's identity could not be read (the fetch is tried again).
        """
        own = ResidueClaim(
            tag, await self.read_database(), residue, self.worker, "serving", True, self.datacenter
        )
        found = rivals(own, self.known())
        if found:
            error = self._refuse(own, found[0], issued=False)
            await self._announce([self._own[tag]])
            raise error
        self._refusals.pop(tag, None)
        self._own[tag] = own
        await self._announce([own])

    def release(self, tag: str) -> None:
        """The tag is gone from this worker (removed from the store): its claim and refusal go too."""
        self._own.pop(tag, None)
        self._refusals.pop(tag, None)

    def claims(self) -> list[ResidueClaim]:
        """This worker's claims now (what it answers a peer's check with)."""
        return list(self._own.values())

    def refusal(self, tag: str) -> ResidueOverlap | None:
        """Why this worker refuses ``tag`` (None: it does not)."""
        return self._refusals.get(tag)

    # -- the peers' claims -------------------------------------------------------------------------

    def known(self) -> list[ResidueClaim]:
        """The peers' claims heard and not forgotten."""
        return [claim for claim, _ in self._peers.values()]

    async def heard(self, claims: Iterable[ResidueClaim]) -> None:
        """Judge claims heard from peers (announced, sent along with a check, or answering ours)."""
        for claim in claims:
            if claim.worker == self.worker:
                continue
            self._peers[(claim.worker, claim.tag)] = (claim, self._round)
            mine = self._own.get(claim.tag)
            if mine is None or mine.state == "refused" or not overlaps(mine, claim):
                continue
            if claim.live:
                # Both hand out (or handed out) intersecting classes: stop, and say so, so that a rival that
                # has not heard this worker stops too.
                error = self._refuse(mine, claim, issued=True)
                if self.on_refuse is not None:
                    self.on_refuse(claim.tag, error)
                await self._announce([self._own[claim.tag]])
            elif (claim.worker, claim.tag) not in self._warned:
                self._warned.add((claim.worker, claim.tag))
                log.warning(
                    "a worker of another database was refused tag %r, whose class intersects this worker's "
                    "(%s): %s",
                    claim.tag,
                    _where(mine),
                    claim.describe(),
                )

    def begin_round(self) -> int:
        """A recheck starts: what is heard from now on belongs to the new round."""
        self._round += 1
        return self._round

    async def end_round(self, round_: int, answers: Iterable[ResidueClaim]) -> None:
        """A recheck ended: forget the peers heard only before it, then judge the answers."""
        self._peers = {key: value for key, value in self._peers.items() if value[1] >= round_}
        await self.heard(answers)

    def _refuse(self, own: ResidueClaim, rival: ResidueClaim, *, issued: bool) -> ResidueOverlap:
        error = ResidueOverlap(
            own.tag, _where(own), rival.describe(), _shared_ids(own.residue, rival.residue)
        )
        self._own[own.tag] = dataclasses.replace(own, state="refused", issued=issued)
        self._refusals[own.tag] = error
        log.error("%s", error)
        return error


def _shared_ids(one: Residue, other: Residue) -> tuple[int, int] | None:
    """The first ID (from 1) both classes hold, and the period after which they meet again."""
    first = one.first_common(other)
    if first is None:
        return None
    period = math.lcm(one.stride, other.stride)
    return (first or period, period)


def _where(claim: ResidueClaim) -> str:
    residue = claim.residue
    return f"{residue.offset} mod {residue.stride} in {claim.database.describe()}"
