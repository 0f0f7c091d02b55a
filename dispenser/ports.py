"""The ports: what the service needs from the outside world, as typing.Protocol classes.

Adapters (``dispenser.adapters``) implement them over real drivers; ``dispenser.testing.fakes`` holds
fakes that pass the same contract tests, for fast unit tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from dispenser.core.daily import DailyPolicy
from dispenser.core.ids import Kind
from dispenser.core.residue import LEAF, Residue
from dispenser.core.segment import Segment

__all__ = [
    "Allocation",
    "Clock",
    "GrantMemory",
    "IdSource",
    "RangesBatch",
    "ReplayStore",
    "ResidueCheck",
    "SegmentStore",
    "Settled",
    "SystemClock",
    "TagInfo",
    "WorkerLease",
    "WorkerRegistry",
]


class RangesBatch(Protocol):
    """What a generator hands out: inclusive ``(first, last)`` ranges in increasing order."""

    @property
    def ranges(self) -> Sequence[tuple[int, int]]:
        """The ranges."""
        ...


class IdSource(Protocol):
    """A generator of IDs by tag (the segment allocator, a snowflake worker)."""

    def try_take(self, tag: str, count: int) -> RangesBatch | None:
        """IDs at once, or ``None`` when they need waiting for (or the tag needs looking up)."""
        ...

    async def take(self, tag: str, count: int, deadline: float) -> RangesBatch:
        """IDs, waiting until ``deadline`` (monotonic seconds) at most."""
        ...


@dataclass(frozen=True, slots=True)
class TagInfo:
    """One row of the ``leaf_alloc`` table."""

    tag: str
    max_id: int
    """The first ID the next segment will hold (Leaf's ``max_id``)."""
    step: int
    """The configured segment size."""
    description: str
    update_time: datetime
    daily: DailyPolicy | None = None
    """A daily tag's format (docs/daily.md): its IDs are the date and a counter per day; None: a plain tag."""
    permuted: bool = False
    """A permuted tag (docs/permuted.md): served only by a worker with its key file, never plain."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """A segment granted by the store, with the tag's configured step at that moment.

    For a tag of a residue class (docs/datacenters.md), ``segment`` holds the class's ordinals, which the
    double buffer hands out; ``residue`` turns them into IDs. For Leaf's tags the two are the same.
    """

    segment: Segment
    configured_step: int
    residue: Residue = LEAF


class SegmentStore(Protocol):
    """Where segments come from: Leaf's ``leaf_alloc`` table, one round trip per segment."""

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        """Reserve the next segment of ``tag``.

        ``tag`` may name a day row of a daily tag (``order@20261128``): the row is created on first use, at
        1 (or above the high water of a removed row of that name), by whichever worker comes first.

        A range of the tag returned unused (:meth:`return_unused`) whose IDs all lie above ``above`` is
        taken first, whole and by one caller only, whatever ``step`` asks for; else a new segment.

        Args:
            tag: the business tag.
            step: the segment size to reserve; ``None`` uses the tag's configured step.
            above: the newest ID the caller holds (-1: none): a returned range at or below it is left
                for another caller, so that each caller's IDs keep increasing.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: the store could not be reached or did not answer in time.
        """
        ...

    async def return_unused(self, tag: str, ranges: Sequence[tuple[int, int]], worker: str) -> int:
        """Give back IDs of ``tag`` granted to the caller and never handed out, in one transaction.

        The caller must hand none of them out afterwards (its buffer is closed first). A later
        :meth:`next_segment` of the tag hands each range out again, once. A range is kept only if it can
        be a grant of the tag as it is now: its IDs of the tag's class, below the tag's high water, and
        none of a removed incarnation of the tag (the rest are dropped: lost, never repeated).

        Args:
            tag: the business tag.
            ranges: inclusive ``(first, last)`` ranges of IDs (not ordinals), each within one segment.
            worker: who returns them, for the record.

        Returns:
            How many IDs were kept for a later fetch.

        Raises:
            StoreUnavailable: the store could not be reached (nothing was kept).
        """
        ...

    async def list_tags(self) -> list[TagInfo]:
        """All tags, ordered by name; a daily tag's day rows are not listed (its policy is in its info).

        Raises:
            StoreUnavailable: the store could not be reached.
        """
        ...

    async def add_tag(
        self,
        tag: str,
        step: int,
        start: int = 1,
        description: str = "",
        *,
        residue: Residue = LEAF,
        daily: DailyPolicy | None = None,
        permuted: bool = False,
    ) -> TagInfo:
        """Create a tag whose first ID will be ``start`` (or the first of ``residue``'s class from there).

        With ``permuted``, a permuted tag (docs/permuted.md), marked in the same transaction: no worker
        serves its counters plain.

        With ``daily``, a daily tag (docs/daily.md): its IDs come from one counter row per day
        (``<tag>@YYYYMMDD``, created on its first fetch at 1, each day row granted as a tag's segments are),
        so ``start`` must be 1 and ``residue`` Leaf's.

        Raises:
            TagExists: the tag is already there.
            TagStartTooLow: the tag was removed, and ``start`` is below the IDs it handed out.
            InvalidTag: the name is not valid.
        """
        ...

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Change a tag's configured step (takes effect at its next segment; a daily tag's day rows too).

        Raises:
            UnknownTag: no such tag.
        """
        ...

    async def set_daily(self, tag: str, daily: DailyPolicy) -> TagInfo:
        """Change a daily tag's width or zone (docs/daily.md; workers take it in at their next tag refresh).

        Safe for uniqueness: IDs of two widths have different numbers of digits, and each date's counter is
        one row whatever the zone that names the date.

        Raises:
            UnknownTag: no such tag.
            BadRequest: the tag is not daily (a plain tag's IDs could meet a daily tag's: make a new tag).
        """
        ...

    async def set_permuted(self, tag: str, permuted: bool) -> TagInfo:
        """Mark a tag permuted, or plain again (docs/permuted.md; workers take it in at their next tag refresh).

        Safe for uniqueness either way: a plain counter is below ``10**18`` and a permuted ID at or above it,
        which is why a tag past ``store_rules.MAX_MARKED_MAX_ID`` is refused.

        Raises:
            UnknownTag: no such tag.
            BadRequest: marking a daily tag, or one past ``store_rules.MAX_MARKED_MAX_ID``.
        """
        ...

    async def remove_tag(self, tag: str) -> None:
        """Delete a tag. Its high water is kept: adding it again below that raises ``TagStartTooLow``.

        Raises:
            UnknownTag: no such tag.
        """
        ...

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Save each tag's fleet-wide peak consumption rate (IDs/s) and the Unix time it was last seen.

        One value per tag, the last writer wins: every worker writes the fleet's peak as it sees it (the
        live workers' peaks summed, or the highest such sum it remembers), so any writer is right.

        Raises:
            StoreUnavailable: the store could not be reached.
        """
        ...

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """The saved ``tag → (peak IDs/s, Unix seconds seen)`` of ``kind``.

        Raises:
            StoreUnavailable: the store could not be reached.
        """
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class GrantMemory(Protocol):
    """What a worker remembers of the segments it was granted, so that a primary that lost them is repaired.

    With asynchronous replication a promoted replica can miss the last ``max_id`` updates; a worker that
    remembers the highest ``max_id`` it was granted per tag raises the new primary's rows back before it
    fetches again (see docs/ha.md).
    """

    async def remembered(self, cluster: str) -> dict[str, int]:
        """Tag → the highest ``max_id`` granted in ``cluster`` (``<system identifier>/<database>``).

        Granted to this worker, and to any worker whose memory this one can read (one sharing its state
        directory), on any timeline of the cluster: a primary on an earlier timeline (a restored backup)
        lost them just as a promoted replica does. Reads what it must within a bound (a stalled disk gives
        what was last read).
        """
        ...

    def floor(self, cluster: str, tag: str) -> int | None:
        """The highest ``max_id`` of ``tag`` in ``cluster`` this worker knows to have been granted (None: none).

        Its own grants, and the other memories of :meth:`remembered` as last read: every fetch raises the
        row to it first, in the same statement, so that this worker never takes a range below it.
        """
        ...

    async def remember(self, cluster: str, tag: str, max_id: int) -> None:
        """Record a grant; returns once it is durable (a restarted worker will remember it).

        Raises:
            StoreUnavailable: it could not be made durable within a bound (a stalled disk): the grant is
                remembered in memory, and its segment must not be handed out.
        """
        ...

    def stalled(self) -> str | None:
        """Why no grant can be made durable now (a write that outlasted its bound is still under way), or None.

        A fetch asks first, so that a stalled disk costs no segment (a grant that could not be remembered
        is skipped, a gap).
        """
        ...

    def server(self, cluster: str) -> str | None:
        """The identity of the primary this worker last used for ``cluster`` (system ID and timeline)."""
        ...

    async def set_server(self, cluster: str, identity: str) -> None:
        """Record the primary now in use for ``cluster``."""
        ...


@dataclass(frozen=True, slots=True)
class Settled:
    """The answer a ``request_id`` is bound to: the first one any worker recorded for it."""

    count: int
    format: str
    ranges: tuple[tuple[int, int], ...]
    """Inclusive ``(first, last)`` ranges, in increasing order."""


class ReplayStore(Protocol):
    """Where the fleet's answers to requests with a ``request_id`` are kept for the dedup TTL.

    A retry may reach any worker of the queue group (or consumer group); the first answer recorded for a
    key is the answer, whichever worker recorded it.
    """

    def settle(
        self,
        key: tuple[str, str, str],
        count: int,
        format: str,
        ranges: tuple[tuple[int, int], ...],
        ttl: float,
    ) -> Awaitable[Settled]:
        """Record ``ranges`` as the answer to ``key`` unless a live answer is already recorded.

        An ``async def``, or a function that returns a future (no task per call on a path every request
        with a ``request_id`` takes); the caller may cancel what it awaits when its deadline comes.

        Args:
            key: ``(kind, tag, request_id)``.
            count: the request's count (a retry must repeat it).
            format: the request's format (likewise).
            ranges: the IDs this worker drew for the request.
            ttl: seconds the answer stays bound to the key (an expired one is replaced).

        Returns:
            The recorded answer: ours if we were first, else the earlier one (our IDs are then unused
            gaps, never handed out).

        Raises:
            StoreUnavailable: the store could not be reached (the request fails, retryably).
            StoreRefusedValue: the store refused a value of this request (the request fails, not
                retryably); it fails no other request.
        """
        ...

    async def sweep(self) -> int:
        """Delete expired answers; return how many."""
        ...


@dataclass(frozen=True, slots=True)
class WorkerLease:
    """A snowflake worker ID held by this process, with the highest timestamp recorded for it."""

    worker_id: int
    high_water_ms: int
    """The last millisecond recorded as used under this worker ID (0 if never): issue only above it."""


class WorkerRegistry(Protocol):
    """Where snowflake worker IDs come from: ZooKeeper, a lease in ZooKeeper, Postgres, or config."""

    async def register(self) -> WorkerLease:
        """Obtain this worker's ID and its recorded high-water timestamp.

        May be called again: after :class:`CoordinatorUnavailable` (the shell retries while it runs from
        the local cache), and after :meth:`can_issue` turned false or :meth:`report` raised ``LeaseLost``.
        It then returns the lease now held, possibly under another worker ID: the shell must honour its
        ``high_water_ms`` again before issuing.

        Raises:
            WorkerIdsExhausted: every worker ID the layout allows is taken.
            CoordinatorUnavailable: the registry could not be reached (the shell may fall back to the
                local cache, in the modes where that is safe).
        """
        ...

    async def report(self, high_water_ms: int) -> None:
        """Record that IDs up to ``high_water_ms`` may have been issued (called every few seconds).

        Raises:
            CoordinatorUnavailable: the record could not be written now (keep calling on the timer).
            LeaseLost: this worker no longer holds its ID; stop issuing and :meth:`register` again.
        """
        ...

    def can_issue(self) -> bool:
        """Whether this worker may issue IDs now (false once a lease can no longer be proved)."""
        ...

    async def close(self) -> None:
        """Release the registration (ephemeral nodes, connections)."""
        ...


class Clock(Protocol):
    """Time as the shell reads it; tests pass a controllable one."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, never going back."""
        ...

    def wall_ms(self) -> int:
        """Unix time in milliseconds (may go back: that is what snowflake must survive)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's monotonic time (a manual clock wakes the sleeper when moved)."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall_ms(self) -> int:
        """``time.time_ns() // 1_000_000``."""
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep(seconds)``."""
        await asyncio.sleep(seconds)


class ResidueCheck(Protocol):
    """Whether this worker may serve a tag's class: no other database serves an intersecting one.

    :class:`~dispenser.service.residues.ResidueGuard` is the one implementation (docs/datacenters.md); the
    segment allocator asks it before a tag's first ID (:class:`~dispenser.service.segments.TagAllocator`).
    """

    async def claim(self, tag: str, residue: Residue) -> None:
        """Claim ``tag``'s class before its first ID is handed out.

        Raises:
            ResidueOverlap: another database serves an intersecting class of ``tag``.
            DispenserError: the claim could not be made now (the fetch is tried again).
        """
        ...

    def release(self, tag: str) -> None:
        """The tag is gone from this worker."""
        ...
