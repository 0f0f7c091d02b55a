"""An ordered tag's lease, as its holder times it: when to renew, and until when it may answer.

The store's clock alone decides when a lease has expired (the next holder takes it only once the store's
``expires_at`` has passed); the holder counts from the moment it *sent* the take or renewal, on its own
monotonic clock, and stops answering ahead of that expiry. Pure: no clock is read here (docs/ordered.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DRIFT", "MIN_TTL", "LeaseTiming", "Term"]

DRIFT: Final = 0.01
"""How far apart two clocks' rates may be (1 %): the holder's and the store's. The assumption ZooKeeper's
session timeouts and etcd's leases make too; a clock that jumps (a stepped wall clock on the database) is
outside it (docs/ordered.md, "The clock assumption")."""

MIN_TTL: Final = 0.3
"""The shortest lease the store accepts (seconds)."""


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The timing of a lease of ``ttl`` seconds (the row's ``lease_ttl``)."""

    ttl: float

    def __post_init__(self) -> None:
        if not self.ttl >= MIN_TTL:
            raise ValueError(f"a lease lasts at least {MIN_TTL} s, not {self.ttl}")

    @property
    def renew_every(self) -> float:
        """Seconds between renewals (and between a candidate's tries): two tries before the margin."""
        return self.ttl / 3

    @property
    def margin(self) -> float:
        """Seconds the holder stops answering before its lease can expire.

        A pause up to this long between the check and the reply (a scheduler's, a collector's) cannot put an
        answer after the next owner's.
        """
        return self.ttl / 6

    def serving_until(self, sent_at: float) -> float:
        """Until when (the holder's monotonic seconds) it may answer, for a take or renewal sent at ``sent_at``.

        The store set ``expires_at`` to its own clock's reading *after* the statement arrived, plus ``ttl``:
        at least ``ttl`` of real time after ``sent_at`` by the store's clock, so at least ``ttl / (1 + DRIFT)``
        by the holder's; the margin comes off that.
        """
        return sent_at + self.ttl / (1 + DRIFT) - self.margin


@dataclass(frozen=True, slots=True)
class Term:
    """One holding of the lease: its epoch (the store's fence), and until when the holder answers."""

    epoch: int
    until: float

    def serving(self, now: float) -> bool:
        """Whether the holder may still answer at ``now`` (its monotonic seconds)."""
        return now < self.until
