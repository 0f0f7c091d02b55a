"""A per-caller ID budget: token buckets of IDs, one per caller, on a clock the caller passes in. Pure.

One HTTP caller asking ``?count=1000000&format=ranges`` as fast as it can would burn a tag's ID space (2^53,
JavaScript's safe integers, in days) and skew the step. Each caller gets ``rate`` IDs a second, with bursts
up to ``burst``; a request over what is left waits (the caller is told when to retry), and a request larger
than ``burst`` can never be granted. The number of callers remembered is bounded: a bucket that has filled up
again is the same as a new one and is forgotten first.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IdBudget"]


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float


class IdBudget:
    """Token buckets of IDs by caller: ``rate`` IDs a second, at most ``burst`` at once.

    Args:
        rate: IDs a second each caller may take, sustained (> 0).
        burst: the most a caller may take at once, and the bucket's size (>= 1).
        max_callers: how many callers' buckets are kept; past it, full buckets are forgotten first, then the
            oldest (which gives that caller a fresh burst: the bound keeps memory flat under many addresses).
    """

    __slots__ = ("_buckets", "burst", "max_callers", "rate")

    def __init__(self, rate: float, burst: float, max_callers: int = 10_000) -> None:
        if rate <= 0 or burst < 1 or max_callers < 1:
            raise ValueError(
                f"an ID budget needs rate > 0, burst >= 1, max_callers >= 1 (got {rate}, {burst})"
            )
        self.rate = rate
        self.burst = burst
        self.max_callers = max_callers
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def charge(self, caller: str, count: int, now: float) -> float:
        """Take ``count`` IDs from ``caller``'s budget at ``now`` (seconds, any monotonic origin).

        Returns:
            0.0 if granted (and taken); otherwise the seconds until the same request would be granted
            (``inf`` when ``count`` is over the burst and never can be). Nothing is taken when refused.
        """
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= self.max_callers:
                self._forget(now)
            bucket = self._buckets[caller] = _Bucket(self.burst, now)
        elif now > bucket.at:
            bucket.level = min(self.burst, bucket.level + (now - bucket.at) * self.rate)
            bucket.at = now
        if count <= bucket.level:
            bucket.level -= count
            return 0.0
        if count > self.burst:
            return float("inf")
        return (count - bucket.level) / self.rate

    def _forget(self, now: float) -> None:
        """Make room for one more caller: drop every bucket that is full again, else the oldest."""
        full = [
            caller
            for caller, bucket in self._buckets.items()
            if bucket.level + (now - bucket.at) * self.rate >= self.burst
        ]
        for caller in full:
            del self._buckets[caller]
        if not full:
            del self._buckets[next(iter(self._buckets))]
