"""In-memory fakes of the ports, held to the same contract tests as the real adapters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from dispenser.core.daily import DailyPolicy, parse_day_tag
from dispenser.core.errors import (
    CoordinatorUnavailable,
    LeaseLost,
    StoreUnavailable,
    TagExists,
    TagStartTooLow,
    UnknownTag,
    WorkerIdsExhausted,
)
from dispenser.core.ids import Kind
from dispenser.core.residue import LEAF, Residue, StridedRange
from dispenser.core.store_rules import MAX_ID, check_mark, check_new_tag, check_step, no_room, not_daily
from dispenser.ports import Allocation, Settled, TagInfo, WorkerLease

__all__ = [
    "MemoryReplayStore",
    "MemorySegmentStore",
    "MemoryWorkerRegistry",
    "MemoryWorkerTable",
]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class _Row:
    max_id: int
    step: int
    description: str
    update_time: datetime


class MemorySegmentStore:
    """A :class:`~dispenser.ports.SegmentStore` in a dict, with knobs for tests.

    Behaves like the Postgres adapter (same errors, same validation, tags listed in code point order) and
    yields to the event loop on every call, as a round trip would, so concurrent callers interleave.

    Attributes:
        calls: how many times :meth:`next_segment` was called (each a round trip for the real store),
            counting calls that failed.
        fail_with: when set, every call except :meth:`close` raises it instead of touching the rows.
        delay: seconds each :meth:`next_segment` takes (``asyncio.sleep``), to model a slow database.
    """

    def __init__(self, *, now: Callable[[], datetime] = _utc_now) -> None:
        """Create an empty store.

        Args:
            now: the clock stamped into ``update_time``.
        """
        self._rows: dict[str, _Row] = {}
        self._residues: dict[str, Residue] = {}
        """Tags of a residue class (the dispenser_tag_residue table); absent: Leaf's."""
        self._daily: dict[str, DailyPolicy] = {}
        """Daily tags' policies (the dispenser_tag_daily table); their day rows are rows of ``_rows``."""
        self._permuted: set[str] = set()
        """Permuted tags (the dispenser_tag_permuted table)."""
        self._removed: dict[str, int] = {}
        """Removed tags' high water (max_id), as the tombstone table keeps it."""
        self._returned: dict[str, list[tuple[int, int, Residue]]] = {}
        """Ranges returned unused, by tag, oldest return first: IDs and the class they were granted in."""
        self._now = now
        self._closed = False
        self.calls = 0
        self.peaks: dict[str, dict[str, tuple[float, float]]] = {}
        """Saved rate peaks, by kind."""
        self.fail_with: Exception | None = None
        self.delay = 0.0

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Save each tag's fleet peak and when it was last seen (the last writer wins)."""
        self._check()
        self.peaks.setdefault(kind, {}).update(peaks)

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """The saved peaks of ``kind``."""
        self._check()
        return dict(self.peaks.get(kind, {}))

    def set_unavailable(self, unavailable: bool = True) -> None:
        """Make every call raise :class:`StoreUnavailable` (or stop), as if the database were down."""
        self.fail_with = StoreUnavailable("the in-memory store was made unavailable") if unavailable else None

    def _check(self) -> None:
        if self._closed:
            raise StoreUnavailable("the in-memory store is closed")
        if self.fail_with is not None:
            # Drop the previous raise's traceback: re-raising one instance would keep growing it.
            raise self.fail_with.with_traceback(None)

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        """Reserve the next segment of ``tag``, a returned range above ``above`` first (see the port)."""
        if step is not None:
            check_step(step)
        self.calls += 1
        await asyncio.sleep(self.delay)
        self._check()
        row = self._rows.get(tag) or self._open_day(tag)
        if row is None:
            raise UnknownTag(tag)
        residue = self._residues.get(tag, LEAF)
        returned = self._returned.get(tag, [])  # oldest first: taken in that order only, as Postgres does
        if returned and returned[0][0] > above and returned[0][2] == residue:
            first, last, _ = returned.pop(0)
            return Allocation(
                residue.to_ordinals(StridedRange(first, last, residue.stride)), row.step, residue
            )
        used = row.step if step is None else step
        if row.max_id > MAX_ID - residue.advance(used):
            raise no_room(tag, used)
        row.max_id += residue.advance(used)
        row.update_time = self._now()
        return Allocation(residue.to_ordinals(residue.grant(row.max_id, used)), row.step, residue)

    async def return_unused(self, tag: str, ranges: Sequence[tuple[int, int]], worker: str) -> int:
        """Keep the ranges that can be grants of ``tag`` as it is now, for later fetches (see the port)."""
        await asyncio.sleep(0)
        self._check()
        row = self._rows.get(tag)
        if row is None:
            return 0
        residue = self._residues.get(tag, LEAF)
        removed_below = self._removed.get(tag, 0)
        kept = 0
        returned = self._returned.setdefault(tag, [])
        for first, last in sorted(ranges):
            ok = removed_below <= first <= last < row.max_id and residue.owns(first) and residue.owns(last)
            if ok:
                returned.append((first, last, residue))
                kept += StridedRange(first, last, residue.stride).count
        return kept

    def _open_day(self, name: str) -> _Row | None:
        """A daily tag's day row on its first fetch (at 1, or its removed high water), as Postgres does."""
        day_row = parse_day_tag(name)
        parent = None if day_row is None else self._rows.get(day_row[0])
        if day_row is None or parent is None or day_row[0] not in self._daily:
            return None
        start = max(1, self._removed.get(name, 1))
        row = self._rows[name] = _Row(
            start, parent.step, f"day counter of daily tag {day_row[0]}", self._now()
        )
        return row

    async def list_tags(self) -> list[TagInfo]:
        """All tags, ordered by name, without daily tags' day rows."""
        await asyncio.sleep(0)
        self._check()
        return [self._info(tag, self._rows[tag]) for tag in sorted(self._rows) if parse_day_tag(tag) is None]

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
        """Create a tag whose first segment starts at ``start`` (its class's first ID from there), or a daily one."""
        check_new_tag(tag, step, start, description, residue=residue, daily=daily)
        await asyncio.sleep(0)
        self._check()
        if tag in self._rows:
            raise TagExists(tag)
        high_water = self._removed.get(tag)
        if high_water is not None and start < high_water:
            raise TagStartTooLow(tag, start, high_water)
        row = self._rows[tag] = _Row(start, step, description, self._now())
        if residue.plain:
            self._residues.pop(tag, None)
        else:
            self._residues[tag] = residue
        if daily is None:
            self._daily.pop(tag, None)
        else:
            self._daily[tag] = daily
        if permuted:
            self._permuted.add(tag)
        return self._info(tag, row)

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Change a tag's configured step (used from its next segment on)."""
        check_step(step)
        await asyncio.sleep(0)
        self._check()
        row = self._rows.get(tag)
        if row is None:
            raise UnknownTag(tag)
        row.step = step
        row.update_time = self._now()
        if tag in self._daily:
            for name, day_row in self._rows.items():
                if (parse_day_tag(name) or ("", 0))[0] == tag:
                    day_row.step = step
        return self._info(tag, row)

    async def set_daily(self, tag: str, daily: DailyPolicy) -> TagInfo:
        """Change a daily tag's width or zone."""
        await asyncio.sleep(0)
        self._check()
        row = self._rows.get(tag)
        if row is None or parse_day_tag(tag) is not None:
            raise UnknownTag(tag)
        if tag not in self._daily:
            raise not_daily(tag)
        self._daily[tag] = daily
        return self._info(tag, row)

    async def set_permuted(self, tag: str, permuted: bool) -> TagInfo:
        """Mark a tag permuted or plain."""
        await asyncio.sleep(0)
        self._check()
        row = self._rows.get(tag)
        if row is None or parse_day_tag(tag) is not None:
            raise UnknownTag(tag)
        if permuted:
            check_mark(tag, row.max_id, daily=tag in self._daily)
            self._permuted.add(tag)
        else:
            self._permuted.discard(tag)
        return self._info(tag, row)

    async def remove_tag(self, tag: str) -> None:
        """Delete a tag."""
        await asyncio.sleep(0)
        self._check()
        row = self._rows.pop(tag, None)
        if row is None:
            raise UnknownTag(tag)
        self._removed[tag] = max(row.max_id, self._removed.get(tag, 0))
        self._returned.pop(tag, None)  # returned ranges go with the tag: never after a re-add
        self._residues.pop(tag, None)
        self._daily.pop(tag, None)  # its day rows stay: the same daily tag added again goes on with them
        self._permuted.discard(tag)  # a re-added tag is not permuted unless told again, as in PostgreSQL

    async def close(self) -> None:
        """Refuse further calls, as a closed pool does. Idempotent."""
        self._closed = True

    def _info(self, tag: str, row: _Row) -> TagInfo:
        return TagInfo(
            tag,
            row.max_id,
            row.step,
            row.description,
            row.update_time,
            self._daily.get(tag),
            tag in self._permuted,
        )


class MemoryReplayStore:
    """A :class:`~dispenser.ports.ReplayStore` in a dict: one process's fleet, for tests.

    Attributes:
        fail_with: when set, every call raises it (a database that is down).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        """Create an empty store.

        Args:
            clock: seconds (monotonic) against which answers expire.
        """
        self._clock = clock
        self._answers: dict[tuple[str, str, str], tuple[float, Settled]] = {}
        self.fail_with: Exception | None = None

    def __len__(self) -> int:
        return len(self._answers)

    async def settle(
        self,
        key: tuple[str, str, str],
        count: int,
        format: str,
        ranges: tuple[tuple[int, int], ...],
        ttl: float,
    ) -> Settled:
        """Record the answer unless a live one exists; return the recorded one."""
        await asyncio.sleep(0)  # a round trip: let concurrent callers interleave
        if self.fail_with is not None:
            raise self.fail_with
        now = self._clock()
        held = self._answers.get(key)
        if held is not None and held[0] > now:
            return held[1]
        settled = Settled(count, format, tuple(ranges))
        self._answers[key] = (now + ttl, settled)
        return settled

    async def sweep(self) -> int:
        """Delete expired answers."""
        if self.fail_with is not None:
            raise self.fail_with
        now = self._clock()
        expired = [key for key, (until, _) in self._answers.items() if until <= now]
        for key in expired:
            del self._answers[key]
        return len(expired)


class MemoryWorkerTable:
    """The shared record of a fleet of :class:`MemoryWorkerRegistry` (what the database or ZooKeeper is)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        """Address → ``[worker ID, high-water ms]``; delete one to take a worker's ID away."""


class MemoryWorkerRegistry:
    """A :class:`~dispenser.ports.WorkerRegistry` keyed by address, like ``postgres`` and ``zookeeper`` modes.

    Held to the same contract tests as the real registries: an address keeps its worker ID and its highest
    reported mark, new addresses get the smallest free ID, exhaustion names the limit, and a removed record
    means :class:`LeaseLost`.

    Attributes:
        fail_with: when set, every call raises it (a registry that is down).
    """

    def __init__(self, table: MemoryWorkerTable, address: str, *, max_worker_id: int = 1023) -> None:
        """Register ``address`` in ``table`` (on :meth:`register`), with IDs up to ``max_worker_id``."""
        self._table = table
        self._address = address
        self._max = max_worker_id
        self._registered = False
        self._worker_id = -1
        self.fail_with: Exception | None = None

    async def register(self) -> WorkerLease:
        """This address's worker ID and recorded mark (a new address: the smallest free ID, mark 0)."""
        await asyncio.sleep(0)
        if self.fail_with is not None:
            raise self.fail_with
        rows = self._table.rows
        row = rows.get(self._address)
        if row is None:
            taken = {worker_id for worker_id, _ in rows.values()}
            free = next((i for i in range(self._max + 1) if i not in taken), None)
            if free is None:
                raise WorkerIdsExhausted(self._max + 1, "the memory registry")
            row = rows[self._address] = [free, 0]
        self._registered = True
        self._worker_id = row[0]
        return WorkerLease(row[0], row[1])

    async def report(self, high_water_ms: int) -> None:
        """Raise the recorded mark (never lower it)."""
        await asyncio.sleep(0)
        if self.fail_with is not None:
            raise self.fail_with
        if self._worker_id < 0:  # no lease yet: nothing to write, as the real registries answer
            raise CoordinatorUnavailable(f"{self._address} has not registered yet")
        row = self._table.rows.get(self._address)
        if row is None:
            self._registered = False
            raise LeaseLost(self._worker_id, f"the record of {self._address} was removed")
        row[1] = max(row[1], high_water_ms)

    def can_issue(self) -> bool:
        """Registered, and the record is still there as far as this worker knows."""
        return self._registered

    async def close(self) -> None:
        """Nothing to release (the record stays, as a persistent node or row does)."""
        self._registered = False
