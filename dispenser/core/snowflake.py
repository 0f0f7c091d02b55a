"""Snowflake IDs: the bit layout as data, and one worker's generator state, deciding without reading a clock.

An ID is ``0 | timestamp | datacenter | worker | sequence`` (``docs/snowflake.md``, "The layout").
:meth:`SnowflakeState.issue` is Leaf's ``SnowflakeIDGenImpl.get`` turned inside out: given the wall-clock
reading, it returns :class:`Issued` ranges or a :class:`WaitUntil`; the shell's loop
(:meth:`dispenser.service.snowflake.SnowflakeGenerator.take`) reads the clock, sleeps, and runs one take at
a time per worker (a ``take`` after ``WaitUntil(reason="clock_back")`` is the promised re-check).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from dispenser.core.errors import (
    ClockBehindRecorded,
    ClockMovedBackwards,
    ClockOutOfRange,
    InvalidCount,
    InvalidId,
    InvalidLayout,
    WorkerIdOutOfRange,
)

__all__ = [
    "LEAF_EPOCH_MS",
    "Decoded",
    "Issued",
    "SnowflakeLayout",
    "SnowflakeState",
    "WaitReason",
    "WaitUntil",
    "check_startup_clock",
]

LEAF_EPOCH_MS = 1288834974657
"""2010-11-04T01:42:54.657Z, the epoch of Twitter's snowflake and of Leaf."""

_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The last millisecond a `datetime` can hold (9999-12-31T23:59:59.999Z): every ID must decode to a date.
_DATETIME_MAX_MS = (datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC) - _UNIX_EPOCH) // timedelta(
    milliseconds=1
)
_ID_BITS = 63  # the sign bit stays 0


def _ms_to_datetime(unix_ms: int) -> datetime:
    # timedelta arithmetic is exact; datetime.fromtimestamp(ms / 1000) goes through a float.
    return _UNIX_EPOCH + timedelta(milliseconds=unix_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class SnowflakeLayout:
    """How the 63 usable bits of an ID are split, and where time starts.

    Attributes:
        timestamp_bits: Width of the milliseconds-since-epoch field (at least 1).
        datacenter_bits: Width of the datacenter id field, between the timestamp and the worker id (0: no
            such field, Leaf's layout).
        worker_bits: Width of the worker id field (0 allows a single worker, id 0).
        sequence_bits: Width of the per-millisecond sequence field (0 allows one ID per ms).
        epoch_ms: Unix milliseconds that timestamp 0 stands for (not before 1970).

    Raises:
        InvalidLayout: the fields sum to more than 63 bits, a width is out of range, the epoch is negative,
            or the timestamp field would outlast the year 9999 (give those bits to worker or sequence).
    """

    timestamp_bits: int = 41
    worker_bits: int = 10
    sequence_bits: int = 12
    epoch_ms: int = LEAF_EPOCH_MS
    datacenter_bits: int = 0

    def __post_init__(self) -> None:
        for name in ("timestamp_bits", "datacenter_bits", "worker_bits", "sequence_bits", "epoch_ms"):
            value = getattr(self, name)
            if type(value) is not int:
                raise InvalidLayout(f"{name} must be an integer, got {value!r}")
        if self.timestamp_bits < 1:
            raise InvalidLayout(f"timestamp_bits must be at least 1, got {self.timestamp_bits}")
        if self.datacenter_bits < 0 or self.worker_bits < 0 or self.sequence_bits < 0:
            raise InvalidLayout(
                f"datacenter_bits, worker_bits and sequence_bits must not be negative, got "
                f"{self.datacenter_bits}, {self.worker_bits} and {self.sequence_bits}"
            )
        total = self.timestamp_bits + self.datacenter_bits + self.worker_bits + self.sequence_bits
        if total > _ID_BITS:
            # Leaf issue #106: a 64th bit is the sign bit, and IDs would turn negative.
            dc = f"datacenter_bits {self.datacenter_bits} + " if self.datacenter_bits else ""
            raise InvalidLayout(
                f"timestamp_bits {self.timestamp_bits} + {dc}worker_bits {self.worker_bits} + "
                f"sequence_bits {self.sequence_bits} = {total}, "
                f"over the {_ID_BITS} bits a non-negative 64-bit ID has"
            )
        if self.epoch_ms < 0:
            raise InvalidLayout(f"epoch_ms must not be before 1970, got {self.epoch_ms}")
        if self.max_timestamp_ms > _DATETIME_MAX_MS:
            raise InvalidLayout(
                f"a {self.timestamp_bits}-bit timestamp from epoch {self.epoch_ms} runs past the year 9999; "
                "use fewer timestamp bits"
            )

    @property
    def max_datacenter_id(self) -> int:
        """The largest datacenter id the layout can hold (0 without datacenter bits)."""
        return (1 << self.datacenter_bits) - 1

    @property
    def max_worker_id(self) -> int:
        """The largest worker id the layout can hold."""
        return (1 << self.worker_bits) - 1

    @property
    def max_sequence(self) -> int:
        """The largest sequence number within one millisecond."""
        return (1 << self.sequence_bits) - 1

    @property
    def max_timestamp_ms(self) -> int:
        """The last valid millisecond in absolute unix ms: the epoch plus ``2**timestamp_bits - 1``."""
        return self.epoch_ms + (1 << self.timestamp_bits) - 1

    @property
    def max_id(self) -> int:
        """The largest ID the layout can produce (all fields at their maximum)."""
        return (1 << (self.timestamp_bits + self.datacenter_bits + self.worker_bits + self.sequence_bits)) - 1

    def node_part(self, datacenter_id: int, worker_id: int) -> int:
        """The datacenter and worker fields of an ID, in place (the bits a worker ORs into all its IDs).

        Raises:
            WorkerIdOutOfRange: ``datacenter_id`` or ``worker_id`` does not fit its field.
        """
        if not 0 <= datacenter_id <= self.max_datacenter_id:
            raise WorkerIdOutOfRange(datacenter_id, self.max_datacenter_id, "datacenter ID")
        if not 0 <= worker_id <= self.max_worker_id:
            raise WorkerIdOutOfRange(worker_id, self.max_worker_id)
        return ((datacenter_id << self.worker_bits) | worker_id) << self.sequence_bits

    def end_datetime(self) -> datetime:
        """The layout's last valid millisecond as a UTC datetime: after it, no ID can be issued."""
        return _ms_to_datetime(self.max_timestamp_ms)

    @property
    def timestamp_shift(self) -> int:
        """Where the timestamp field starts: the datacenter, worker and sequence bits below it."""
        return self.datacenter_bits + self.worker_bits + self.sequence_bits

    def compose(self, timestamp_ms: int, worker_id: int, sequence: int, datacenter_id: int = 0) -> int:
        """Build the ID for a unix-millisecond timestamp, worker id, sequence number and datacenter id.

        Raises:
            ClockOutOfRange: ``timestamp_ms`` is before the epoch or after :attr:`max_timestamp_ms`.
            WorkerIdOutOfRange: ``worker_id`` or ``datacenter_id`` does not fit its field.
            ValueError: ``sequence`` does not fit the sequence field.
        """
        if not self.epoch_ms <= timestamp_ms <= self.max_timestamp_ms:
            raise ClockOutOfRange(timestamp_ms, self.epoch_ms, self.max_timestamp_ms)
        node = self.node_part(datacenter_id, worker_id)
        if not 0 <= sequence <= self.max_sequence:
            raise ValueError(f"sequence {sequence} does not fit the layout (0 to {self.max_sequence})")
        return ((timestamp_ms - self.epoch_ms) << self.timestamp_shift) | node | sequence

    def decompose(self, snowflake_id: int) -> Decoded:
        """Split an ID into its unix-millisecond timestamp (this layout's epoch), datacenter, worker, sequence.

        Raises:
            InvalidId: the number is negative or wider than the layout.
        """
        if not 0 <= snowflake_id <= self.max_id:
            raise InvalidId(snowflake_id, self.max_id)
        return Decoded(
            timestamp_ms=(snowflake_id >> self.timestamp_shift) + self.epoch_ms,
            worker_id=(snowflake_id >> self.sequence_bits) & self.max_worker_id,
            sequence=snowflake_id & self.max_sequence,
            datacenter_id=(snowflake_id >> (self.worker_bits + self.sequence_bits)) & self.max_datacenter_id,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Decoded:
    """The fields of one ID; ``timestamp_ms`` is absolute unix milliseconds."""

    timestamp_ms: int
    worker_id: int
    sequence: int
    datacenter_id: int = 0

    @property
    def datetime(self) -> datetime:
        """When the ID was issued, as a UTC datetime."""
        return _ms_to_datetime(self.timestamp_ms)


@dataclass(frozen=True, slots=True)
class Issued:
    """IDs issued by one :meth:`SnowflakeState.issue`, as inclusive ``(first, last)`` ranges.

    A batch comes from one millisecond, so it holds one range; ``ranges`` is a list so that the shell can
    concatenate batches into one reply. ``remaining`` is how many of the requested IDs are still owed: the
    millisecond's sequence space ran out first, and the shell calls ``take(now, remaining)`` again.
    """

    ranges: list[tuple[int, int]]
    remaining: int

    @property
    def complete(self) -> bool:
        """Whether every requested ID was issued."""
        return self.remaining == 0

    @property
    def count(self) -> int:
        """How many IDs the batch holds."""
        return sum(last - first + 1 for first, last in self.ranges)


WaitReason = Literal["sequence_exhausted", "clock_back", "high_water"]


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """No ID now: call ``take`` again once the clock reads ``ms`` (always later than the reading passed in).

    ``reason`` is ``"sequence_exhausted"`` (this millisecond's sequence space is used up), ``"clock_back"``
    (the clock went back a little; this is the one wait granted before an error) or ``"high_water"`` (the
    clock has not passed the high-water mark of an earlier run yet).
    """

    ms: int
    reason: WaitReason


def check_startup_clock(now_ms: int, recorded_ms: int, max_wait_ms: int) -> int:
    """How long a worker must wait before its first ID, given the mark recorded for it by an earlier run.

    ``recorded_ms`` is what the registry (ZooKeeper node data) or the local cache file holds for this worker
    (``0`` for one that has never run): no ID may be stamped at or below it. A short wait is fine, since a
    mark may be reserved ahead of the clock; a longer one means the clock went back. This is Leaf's
    start-up check, the shell's before it serves and :class:`SnowflakeState`'s before its first ID.

    Returns:
        Milliseconds until the clock passes ``recorded_ms`` (0 if it already has).

    Raises:
        ClockBehindRecorded: the wait would be longer than ``max_wait_ms``.
    """
    wait_ms = recorded_ms + 1 - now_ms
    if wait_ms > max_wait_ms:
        raise ClockBehindRecorded(recorded_ms, now_ms)
    return max(wait_ms, 0)


class SnowflakeState:
    """The generator state of one worker: which millisecond it is in and the next sequence number.

    Args:
        layout: The bit layout.
        worker_id: This worker's id, ``0 <= worker_id <= layout.max_worker_id``.
        datacenter_id: This worker's datacenter, ``0 <= datacenter_id <= layout.max_datacenter_id``.
        high_water_ms: No ID is ever issued in this millisecond or earlier. The shell passes the high-water
            mark an earlier run recorded (registry or cache file), so that a restart after a clock rollback
            shorter than the report interval cannot reissue IDs (Leaf issue #216). ``0`` means none.
        random_start: Each new millisecond's sequence starts at a random number in ``[0, random_start)``,
            so that low-traffic IDs don't all end in the same digits (people shard on them). ``0`` or ``1``
            starts at 0. It is capped at the sequence space (``layout.max_sequence + 1``).
        max_backward_ms: A run-time clock rollback of at most this many milliseconds is waited out once
            (for twice the offset, as Leaf does); a longer one is an error at once.
        max_startup_wait_ms: Until the first ID is issued, a clock at or behind ``high_water_ms`` is waited
            out if the wait is at most this long; otherwise :class:`ClockBehindRecorded` is raised. This is
            separate from ``max_backward_ms`` on purpose: a high-water mark may legitimately sit a report
            interval ahead of the clock after a quick restart (the shell may persist marks ahead of time), and
            a few seconds' wait before the first ID is harmless, whereas a wait at run time holds up requests
            in flight. Leaf's default report interval is 3 s; the default of 5 s covers it.
        rng: Source of the random starts; pass a seeded ``random.Random`` for reproducible tests.

    Raises:
        WorkerIdOutOfRange: ``worker_id`` or ``datacenter_id`` does not fit the layout.
        ValueError: a negative ``random_start``, ``max_backward_ms`` or ``max_startup_wait_ms``.
    """

    __slots__ = (
        "_behind_waited",
        "_epoch_ms",
        "_high_water_ms",
        "_issued",
        "_last_ms",
        "_max_backward_ms",
        "_max_ms",
        "_max_sequence",
        "_max_startup_wait_ms",
        "_next_sequence",
        "_randrange",
        "_start_bound",
        "_timestamp_shift",
        "_worker_part",
        "datacenter_id",
        "layout",
        "worker_id",
    )

    def __init__(
        self,
        layout: SnowflakeLayout,
        worker_id: int,
        *,
        high_water_ms: int = 0,
        random_start: int = 100,
        max_backward_ms: int = 5,
        max_startup_wait_ms: int = 5_000,
        rng: random.Random | None = None,
        datacenter_id: int = 0,
    ) -> None:
        node_part = layout.node_part(datacenter_id, worker_id)
        for name, value in (
            ("random_start", random_start),
            ("max_backward_ms", max_backward_ms),
            ("max_startup_wait_ms", max_startup_wait_ms),
        ):
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        self.layout = layout
        self.worker_id = worker_id
        self.datacenter_id = datacenter_id
        self._epoch_ms = layout.epoch_ms
        self._max_ms = layout.max_timestamp_ms
        self._max_sequence = layout.max_sequence
        self._timestamp_shift = layout.timestamp_shift
        self._worker_part = node_part
        self._start_bound = min(random_start, layout.max_sequence + 1)
        self._randrange = (rng if rng is not None else random.Random()).randrange
        self._max_backward_ms = max_backward_ms
        self._max_startup_wait_ms = max_startup_wait_ms
        self._high_water_ms = high_water_ms
        # Until the first ID, `_last_ms` is the mark to stay above; the epoch floor means that any reading
        # above it is a valid timestamp (readings at or below it are sorted out in `_before_first`).
        self._last_ms = max(high_water_ms, layout.epoch_ms - 1)
        self._next_sequence = 0
        self._issued = False
        # Set when a small rollback has been granted its one wait; the next reading still behind fails.
        self._behind_waited = False

    @property
    def last_ms(self) -> int:
        """The highest millisecond any ID of this state was issued in (before the first: ``high_water_ms``).

        Every ID from ``take(now_ms, …)`` is stamped with ``now_ms`` itself, so a shell that wants to persist
        a high-water mark ahead of issuing can do so before calling ``take``.
        """
        return self._last_ms if self._issued else self._high_water_ms

    def room(self, now_ms: int) -> int:
        """How many IDs ``take(now_ms, n)`` is sure to issue at once (0 when it would wait or fail).

        For a new millisecond this assumes the largest random start, so a shell can tell whether a batch
        fits without issuing part of it.
        """
        if now_ms > self._last_ms:
            return self._max_sequence + 1 - max(self._start_bound - 1, 0) if now_ms <= self._max_ms else 0
        if now_ms == self._last_ms and self._issued:
            return max(0, self._max_sequence + 1 - self._next_sequence)
        return 0

    def issue(self, now_ms: int, count: int) -> Issued | WaitUntil:
        """Issue up to ``count`` IDs stamped ``now_ms`` (unix ms, read by the caller), or say when to retry.

        Contract:
            * A :class:`Issued` holds IDs stamped ``now_ms``, all greater than every ID issued before by this
              state. If the millisecond's sequence space ran out first, ``batch.remaining > 0``: call again
              (the next call answers ``WaitUntil(now_ms + 1)`` if the clock has not moved on).
            * A :class:`WaitUntil` issues nothing and changes nothing but the clock-back bookkeeping; its
              ``ms`` is always greater than ``now_ms``, so a shell that sleeps until it never spins.
            * Clock behind the last issued millisecond by at most ``max_backward_ms``: the first such reading
              answers ``WaitUntil(now_ms + 2 * offset, "clock_back")``; if the next reading is still behind
              (by any amount), :class:`ClockMovedBackwards` is raised. Further behind: raised at once.
            * Before the first ID, a clock at or behind ``high_water_ms`` answers
              ``WaitUntil(high_water_ms + 1, "high_water")`` if that is at most ``max_startup_wait_ms`` away,
              else raises :class:`ClockBehindRecorded`.

        Raises:
            InvalidCount: ``count < 1``.
            ClockMovedBackwards: see above; no ID was issued.
            ClockBehindRecorded: see above; no ID was issued.
            ClockOutOfRange: ``now_ms`` is before the epoch or past the layout's end; no ID was issued.
        """
        if count < 1:
            raise InvalidCount(count)
        if now_ms > self._last_ms:
            if now_ms > self._max_ms:
                raise ClockOutOfRange(now_ms, self._epoch_ms, self._max_ms)
            sequence = self._randrange(self._start_bound) if self._start_bound > 1 else 0
            self._last_ms = now_ms
            self._issued = True
            self._behind_waited = False
        elif now_ms == self._last_ms and self._issued:
            self._behind_waited = False
            sequence = self._next_sequence
            if sequence > self._max_sequence:
                return WaitUntil(now_ms + 1, "sequence_exhausted")
        elif self._issued:
            return self._behind(now_ms)
        else:
            return self._before_first(now_ms)
        # One range of consecutive sequences: a batch of 4,096 costs what a batch of 1 does.
        issued = self._max_sequence - sequence + 1
        # Not min(): this is the hot path, and the builtin call costs a fifth of it (measured).
        if count < issued:  # noqa: PLR1730
            issued = count
        first = ((now_ms - self._epoch_ms) << self._timestamp_shift) | self._worker_part | sequence
        self._next_sequence = sequence + issued
        return Issued([(first, first + issued - 1)], count - issued)

    def _behind(self, now_ms: int) -> WaitUntil:
        """The clock reads before the last issued millisecond: wait once for a small offset, else fail."""
        offset = self._last_ms - now_ms
        if self._behind_waited or offset > self._max_backward_ms:
            # Reset, so that the next request (after this one failed) gets its own wait, as in Leaf.
            self._behind_waited = False
            raise ClockMovedBackwards(self._last_ms, now_ms)
        self._behind_waited = True
        return WaitUntil(now_ms + 2 * offset, "clock_back")

    def _before_first(self, now_ms: int) -> WaitUntil:
        """Nothing issued yet and the clock is not past the high-water mark (or the epoch)."""
        if now_ms < self._epoch_ms:
            raise ClockOutOfRange(now_ms, self._epoch_ms, self._max_ms)
        # Here `_last_ms` is the high-water mark, since the clock reading is at or above the epoch.
        return WaitUntil(
            now_ms + check_startup_clock(now_ms, self._last_ms, self._max_startup_wait_ms), "high_water"
        )
