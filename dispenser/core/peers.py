"""The start-up check of the local clock against the live peers' clocks (Meituan's blog has it; Leaf's code lacks it)."""

from __future__ import annotations

from dataclasses import dataclass

from dispenser.core.errors import ClockDisagreesWithPeers

__all__ = ["PeerReading", "check_peer_clocks"]


@dataclass(frozen=True, slots=True)
class PeerReading:
    """One peer's answer: its wall clock, and when we sent the question and got the answer (our clock)."""

    peer_ms: int
    sent_ms: int
    received_ms: int
    worker_id: int = -1
    """The peer's snowflake worker ID (-1: not said)."""

    @property
    def round_trip_ms(self) -> int:
        """How long the answer took (a short one gives the sharpest offset)."""
        return self.received_ms - self.sent_ms

    @property
    def offset_ms(self) -> float:
        """The peer's clock minus ours, assuming the answer was made halfway through the round trip."""
        return self.peer_ms - (self.sent_ms + self.received_ms) / 2


def check_peer_clocks(readings: list[PeerReading], threshold_ms: int) -> float | None:
    """Return the mean offset of the peers' clocks from ours (``None`` when alone), or refuse.

    Raises:
        ClockDisagreesWithPeers: our clock is further than ``threshold_ms`` from the peers' mean.
    """
    if not readings:
        return None
    mean = sum(r.offset_ms for r in readings) / len(readings)
    if abs(mean) > threshold_ms:
        raise ClockDisagreesWithPeers(mean, threshold_ms, len(readings))
    return mean
