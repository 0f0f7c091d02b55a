"""Daily serials' pure rules: the day of an instant in a zone, composing and splitting IDs, the width."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.daily import (
    MAX_TAG_LENGTH,
    MAX_WIDTH,
    DailyPolicy,
    check_counter,
    compose,
    day_of,
    day_tag,
    day_window,
    parse_day_tag,
    split,
)
from dispenser.core.errors import BadRequest, DayExhausted
from dispenser.core.tags import TAG_PATTERN

ZONES = ["UTC", "Asia/Shanghai", "America/New_York", "Europe/London", "Australia/Lord_Howe", "Asia/Kolkata"]
# Zones whose clocks jump at local midnight (DST at 00:00), and one that skipped a whole day (Samoa, 2011).
ODD_ZONES = ["America/Santiago", "Asia/Beirut", "America/Havana", "Pacific/Apia", "America/Sao_Paulo"]

widths = st.integers(1, MAX_WIDTH)
days = st.dates(min_value=datetime(1970, 1, 2).date(), max_value=datetime(9999, 12, 31).date()).map(
    lambda d: d.year * 10_000 + d.month * 100 + d.day
)
instants = st.integers(0, 4_102_444_800_000)  # 1970 to 2100, in Unix milliseconds
zones = st.sampled_from(ZONES + ODD_ZONES).map(ZoneInfo)


@given(days, st.data(), widths)
def test_compose_round_trips(day: int, data: st.DataObject, width: int) -> None:
    """split(compose(day, counter)) is (day, counter) for every counter the width holds."""
    counter = data.draw(st.integers(1, 10**width - 1))
    assert split(compose(day, counter, width), width) == (day, counter)


@given(days, days, st.data(), widths)
def test_compose_is_injective(day_a: int, day_b: int, data: st.DataObject, width: int) -> None:
    """Two (day, counter) pairs of one width never give the same ID."""
    a = data.draw(st.integers(1, 10**width - 1))
    b = data.draw(st.integers(1, 10**width - 1))
    if (day_a, a) != (day_b, b):
        assert compose(day_a, a, width) != compose(day_b, b, width)


@given(days, st.data(), widths)
def test_ids_of_a_day_are_ordered_and_contiguous(day: int, data: st.DataObject, width: int) -> None:
    """Within a day the ID follows the counter: ordered, one apart, and below the next day's IDs."""
    a = data.draw(st.integers(1, 10**width - 2))
    assert compose(day, a + 1, width) == compose(day, a, width) + 1
    assert compose(day, 10**width - 1, width) < compose(day + 1, 1, width)


@given(days, widths)
def test_every_id_is_a_positive_64_bit_integer_with_the_date_as_its_leading_digits(
    day: int, width: int
) -> None:
    """The largest ID of the widest counter on 9999-12-31 still fits a signed 64-bit integer."""
    last = compose(day, 10**width - 1, width)
    assert 0 < last < 2**63
    assert str(compose(day, 1, width)) == f"{day}{1:0{width}d}"


def test_a_counter_past_its_width_is_refused() -> None:
    """The counter's last value is 10**width - 1; the next is the error that says when IDs come back."""
    policy = DailyPolicy.checked(3, "Asia/Shanghai")
    check_counter("order", 20261128, 999, policy)
    with pytest.raises(DayExhausted) as info:
        check_counter("order", 20261128, 1000, policy)
    assert info.value.code == "day_exhausted"
    assert info.value.retryable is False
    assert "999 IDs of 20261128" in info.value.message
    assert "Asia/Shanghai" in info.value.message


@pytest.mark.parametrize(
    ("width", "zone", "says"),
    [
        (0, "UTC", "width"),
        (MAX_WIDTH + 1, "UTC", "width"),
        (6, "Mars/Olympus", "time zone"),
        (6, "", "time zone"),
    ],
)
def test_a_bad_policy_is_a_bad_request(width: int, zone: str, says: str) -> None:
    """A width outside 1..10 or a zone the machine does not know is refused, saying which."""
    with pytest.raises(BadRequest, match=says):
        DailyPolicy.checked(width, zone)


@given(instants, zones)
def test_the_window_holds_the_instant_and_its_date(unix_ms: int, zone: ZoneInfo) -> None:
    """day_window's span holds the instant, and its ends have the instant's date."""
    day, start, end = day_window(unix_ms, zone)
    assert day == day_of(unix_ms, zone)
    assert start <= unix_ms < end
    assert day_of(start, zone) == day
    assert day_of(end - 1, zone) == day


@given(instants, zones)
def test_the_date_ends_where_the_window_does(unix_ms: int, zone: ZoneInfo) -> None:
    """At a normal window's end the date is the next one: the worker switches counters exactly there."""
    day, start, end = day_window(unix_ms, zone)
    if end - start > 1:
        assert day_of(end, zone) > day


def test_midnight_in_shanghai_is_16_00_utc() -> None:
    """The tag's zone decides: 2026-11-28 00:00 in Shanghai is 2026-11-27 16:00 UTC."""
    zone = ZoneInfo("Asia/Shanghai")
    midnight = int(datetime.fromisoformat("2026-11-27T16:00:00+00:00").timestamp() * 1000)
    assert day_of(midnight - 1, zone) == 20261127
    assert day_of(midnight, zone) == 20261128
    assert day_window(midnight + 5, zone) == (20261128, midnight, midnight + 86_400_000)


def test_a_day_row_is_named_by_its_tag_and_day_and_no_client_can_name_it() -> None:
    """order@20261128: '@' is outside the tag pattern, so a request can never reach a day row."""
    assert day_tag("order", 20261128) == "order@20261128"
    assert parse_day_tag("order@20261128") == ("order", 20261128)
    assert parse_day_tag("order") is None
    assert parse_day_tag("order@2026112") is None
    assert TAG_PATTERN.fullmatch(day_tag("order", 20261128)) is None
    assert len(day_tag("x" * MAX_TAG_LENGTH, 20261128)) == 128
