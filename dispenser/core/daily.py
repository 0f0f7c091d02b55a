"""Daily serials: an ID is the date ``YYYYMMDD`` then a zero-padded counter that starts again each day.

``20261128000001`` is day 2026-11-28, counter 1, of a tag of width 6: ``ID = YYYYMMDD * 10**width +
counter``. The day is the tag's time zone's date; each day's counter is a segment row of its own
(:func:`day_tag`). Pure: dates from :mod:`zoneinfo`, no clock read here. See ``docs/daily.md``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from dispenser.core.errors import BadRequest, DayExhausted

__all__ = [
    "DAY_SEPARATOR",
    "MAX_TAG_LENGTH",
    "MAX_WIDTH",
    "DailyPolicy",
    "check_counter",
    "compose",
    "day_of",
    "day_tag",
    "day_window",
    "parse_day_tag",
    "split",
    "zone_of",
]

MAX_WIDTH = 10
"""The widest counter: ``99991231 * 10**10 + (10**10 - 1)`` is below ``2**63``; a width of 11 is not."""

DAY_SEPARATOR = "@"
"""Between a tag and its day in a day row's name (``order@20261128``): no valid tag holds it, so no client
can ask for a day row by name."""

MAX_TAG_LENGTH = 128 - len("@YYYYMMDD")
"""A daily tag's longest name: its day rows' names must fit ``leaf_alloc.biz_tag`` (``varchar(128)``)."""

_POWERS: tuple[int, ...] = tuple(10**width for width in range(MAX_WIDTH + 1))

_DAY_ROW = re.compile(r"(.+)@([0-9]{8})")


@functools.lru_cache(maxsize=64)
def zone_of(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (``Asia/Shanghai``, ``UTC``).

    Raises:
        BadRequest: no such zone in this machine's time zone data.
    """
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise BadRequest(
            f"unknown time zone {name!r}: give an IANA name such as 'Asia/Shanghai' or 'UTC'"
        ) from None


@dataclass(frozen=True, slots=True)
class DailyPolicy:
    """A daily tag's format: the counter's digits and the zone whose date the ID carries.

    As read from the store it is not checked (a zone this machine lacks must not stop the tag list);
    :meth:`checked` is for input, and :attr:`zone` raises where the tag is served.
    """

    width: int
    """Digits of the counter (1 to :data:`MAX_WIDTH`): a day holds ``10**width - 1`` IDs."""
    time_zone: str
    """IANA name of the zone whose midnight starts a new counter."""

    @classmethod
    def checked(cls, width: int, time_zone: str) -> DailyPolicy:
        """The policy, refused if the width is out of range or the zone unknown (what ``tag add`` gives).

        Raises:
            BadRequest: saying which.
        """
        if not 1 <= width <= MAX_WIDTH:
            raise BadRequest(f"a daily tag's width must be between 1 and {MAX_WIDTH}, got {width}")
        zone_of(time_zone)
        return cls(width, time_zone)

    @property
    def capacity(self) -> int:
        """The highest counter of a day (``10**width - 1``)."""
        return _POWERS[self.width] - 1

    @property
    def zone(self) -> ZoneInfo:
        """The time zone.

        Raises:
            BadRequest: this machine's time zone data does not know it (a worker answers so, for the tag).
        """
        return zone_of(self.time_zone)


def _number(day: date) -> int:
    return day.year * 10_000 + day.month * 100 + day.day


def day_of(unix_ms: int, zone: ZoneInfo) -> int:
    """The date (``YYYYMMDD``) in ``zone`` at Unix time ``unix_ms``."""
    return _number(datetime.fromtimestamp(unix_ms // 1000, zone).date())


def _midnight_ms(day: date, zone: ZoneInfo) -> int:
    # fold=0 on a local midnight that does not exist (a DST jump at 00:00) is the instant after the gap,
    # the day's first; on one that exists twice, the first of the two.
    return int(datetime(day.year, day.month, day.day, tzinfo=zone).timestamp()) * 1000


def day_window(unix_ms: int, zone: ZoneInfo) -> tuple[int, int, int]:
    """``(day, start_ms, end_ms)``: the date at ``unix_ms`` and a span around it with that date throughout.

    Normally from the day's midnight to the next; ``start_ms <= unix_ms < end_ms`` always holds (where a
    zone's clock goes back across midnight the span shrinks to the instant asked about, so a caller asks
    again at once). A worker caches the span and reads its clock against it: one comparison per request.
    """
    local = datetime.fromtimestamp(unix_ms // 1000, zone).date()
    start = _midnight_ms(local, zone)
    end = _midnight_ms(local + timedelta(days=1), zone)
    if not start <= unix_ms < end:
        start, end = unix_ms, unix_ms + 1
    return _number(local), start, end


def compose(day: int, counter: int, width: int) -> int:
    """The ID of ``counter`` on ``day`` (``YYYYMMDD``): ``day * 10**width + counter``."""
    return day * _POWERS[width] + counter


def split(id_: int, width: int) -> tuple[int, int]:
    """``(day, counter)`` of an ID of a tag of ``width`` (the inverse of :func:`compose`)."""
    return divmod(id_, _POWERS[width])


def check_counter(tag: str, day: int, last: int, policy: DailyPolicy) -> None:
    """Raise :class:`DayExhausted` when counter ``last`` does not fit the policy's width."""
    if last > policy.capacity:
        raise DayExhausted(tag, day, policy.capacity, policy.time_zone)


def day_tag(tag: str, day: int) -> str:
    """The name of ``tag``'s counter row for ``day``: ``order@20261128``."""
    return f"{tag}{DAY_SEPARATOR}{day:08d}"


def parse_day_tag(name: str) -> tuple[str, int] | None:
    """``(tag, day)`` of a day row's name, or ``None`` if ``name`` is not one."""
    match = _DAY_ROW.fullmatch(name)
    if match is None:
        return None
    return match[1], int(match[2])
