"""What the snowflake workers learn from each other on the clock subject.

The start-up check of the local clock against the live peers' clocks (Meituan's blog has it; Leaf's code
lacks it), and the claims on the node bits of IDs that no two live workers may share (Leaf #187).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from dispenser.core.errors import ClockDisagreesWithPeers
from dispenser.core.node_bits import NodeBits, can_collide

__all__ = ["Claim", "ClaimState", "PeerReading", "check_peer_clocks", "mean_offset_ms", "rival_claims"]

ClaimState = Literal["starting", "serving", "refused", ""]
"""A worker's phase: checking its peers, issuing, or refusing to issue ("": an older worker, taken as serving)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A worker's claim on a snowflake ID: its (datacenter, worker) pair and node bits, its run, and its phase."""

    datacenter_id: int
    worker_id: int
    nonce: str
    state: ClaimState
    address: str = ""
    bits: NodeBits | None = None
    """Where its node field sits in its IDs, on its layout (None: a worker older than this field)."""

    @property
    def node(self) -> tuple[int, int]:
        """The (datacenter, worker) pair the claim is on."""
        return (self.datacenter_id, self.worker_id)

    @property
    def issuing(self) -> bool:
        """Whether the claimant issues (or may issue) IDs: serving, or an older worker that does not say."""
        return self.state in ("serving", "")

    def describe(self) -> str:
        """The claimant in a log line."""
        who = self.address or f"run {self.nonce or '?'}"
        return f"{who} ({self.state or 'serving'})"

    def overlaps(self, other: Claim) -> bool:
        """Whether the two claimants can issue one same ID (symmetric).

        Both say their node bits: :func:`~dispenser.core.node_bits.can_collide`, whatever the layouts. A
        worker older than the node bits says only its pair, and was built for one layout across the
        fleet: the pairs are compared, as that worker itself does.
        """
        if self.bits is not None and other.bits is not None:
            return can_collide(self.bits, other.bits)
        return self.node == other.node


def rival_claims(own: Claim, others: Iterable[Claim]) -> list[Claim]:
    """The live peers' claims that can issue one of ``own``'s IDs (ours and refused ones left out)."""
    return [c for c in others if c.nonce != own.nonce and c.state != "refused" and own.overlaps(c)]


@dataclass(frozen=True, slots=True)
class PeerReading:
    """One peer's answer: its wall clock, and when we sent the question and got the answer (our clock)."""

    peer_ms: int
    sent_ms: int
    received_ms: int
    worker_id: int = -1
    """The peer's snowflake worker ID (-1: not said)."""
    claim: Claim | None = None
    """The peer's claim on its ID (None: an older worker, which says only its worker ID)."""

    @property
    def round_trip_ms(self) -> int:
        """How long the answer took (a short one gives the sharpest offset)."""
        return self.received_ms - self.sent_ms

    @property
    def offset_ms(self) -> float:
        """The peer's clock minus ours, assuming the answer was made halfway through the round trip."""
        return self.peer_ms - (self.sent_ms + self.received_ms) / 2


def mean_offset_ms(readings: list[PeerReading]) -> float | None:
    """The mean offset of the peers' clocks from ours, in ms (``None`` when none answered)."""
    if not readings:
        return None
    return sum(r.offset_ms for r in readings) / len(readings)


def check_peer_clocks(readings: list[PeerReading], threshold_ms: int) -> float | None:
    """Return the mean offset of the peers' clocks from ours (``None`` when alone), or refuse.

    Raises:
        ClockDisagreesWithPeers: our clock is further than ``threshold_ms`` from the peers' mean.
    """
    mean = mean_offset_ms(readings)
    if mean is None:
        return None
    if abs(mean) > threshold_ms:
        raise ClockDisagreesWithPeers(mean, threshold_ms, len(readings))
    return mean
