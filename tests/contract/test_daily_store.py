"""Daily tags in the SegmentStore contract (docs/daily.md), against the in-memory fake and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.core.daily import MAX_TAG_LENGTH, DailyPolicy
from dispenser.core.errors import BadRequest, UnknownTag
from dispenser.core.residue import Residue
from dispenser.core.segment import Segment
from dispenser.ports import SegmentStore

POLICY = DailyPolicy.checked(6, "Asia/Shanghai")


async def test_a_daily_tag_is_listed_with_its_policy_and_its_day_rows_are_not(store: SegmentStore) -> None:
    """A daily tag is listed with its width and zone; a day row, opened on its first fetch, is a counter, not a tag."""
    info = await store.add_tag("order", 100, daily=POLICY)
    assert info.daily == POLICY
    await store.add_tag("plain", 10)
    first = await store.next_segment("order@20261128")
    assert first.segment == Segment(1, 100)
    assert first.configured_step == 100
    listed = {i.tag: i.daily for i in await store.list_tags()}
    assert listed == {"order": POLICY, "plain": None}


async def test_workers_opening_a_day_row_at_once_share_one_counter(store: SegmentStore) -> None:
    """Eight first fetches of a new day at the same moment: one row, eight disjoint segments from 1."""
    await store.add_tag("order", 10, daily=POLICY)
    segments = await asyncio.gather(*(store.next_segment("order@20261129") for _ in range(8)))
    assert sorted(a.segment.first for a in segments) == [1 + 10 * i for i in range(8)]
    assert all(a.segment.size == 10 for a in segments)


async def test_a_day_row_needs_a_daily_tag(store: SegmentStore) -> None:
    """No day row for a plain tag or a missing one: the fetch is unknown_tag, and nothing is created."""
    await store.add_tag("plain", 10)
    for name in ("plain@20261128", "missing@20261128"):
        with pytest.raises(UnknownTag):
            await store.next_segment(name)
    assert [i.tag for i in await store.list_tags()] == ["plain"]


@pytest.mark.parametrize(
    ("tag", "start", "residue", "says"),
    [
        ("order", 5, Residue(1, 0), "takes no start"),
        ("order", 1, Residue(2, 0), "no stride"),
        ("x" * (MAX_TAG_LENGTH + 1), 1, Residue(1, 0), "at most 119 characters"),
    ],
)
async def test_a_daily_tag_refuses_a_start_a_stride_and_a_long_name(
    store: SegmentStore, tag: str, start: int, residue: Residue, says: str
) -> None:
    """Each day counts from 1 in one row of one database, named '<tag>@YYYYMMDD' within 128 characters."""
    with pytest.raises(BadRequest, match=says):
        await store.add_tag(tag, 10, start, residue=residue, daily=POLICY)
    assert await store.list_tags() == []


async def test_a_step_change_reaches_the_day_rows(store: SegmentStore) -> None:
    """set_step on a daily tag sizes its day rows' next default segments too."""
    await store.add_tag("order", 10, daily=POLICY)
    assert (await store.next_segment("order@20261128")).segment == Segment(1, 10)
    await store.set_step("order", 50)
    assert (await store.next_segment("order@20261128")).segment == Segment(11, 60)


async def test_a_daily_tag_removed_and_added_again_goes_on_with_its_days(store: SegmentStore) -> None:
    """Its day rows outlive the tag: the same day's counter never starts again at 1."""
    await store.add_tag("order", 10, daily=POLICY)
    await store.next_segment("order@20261128")
    await store.remove_tag("order")
    assert await store.list_tags() == []
    with pytest.raises(UnknownTag):  # no daily tag: no new day row either
        await store.next_segment("order@20261130")
    await store.add_tag("order", 10, daily=POLICY)
    assert (await store.next_segment("order@20261128")).segment == Segment(11, 20)


async def test_a_removed_day_row_opens_again_above_its_high_water(store: SegmentStore) -> None:
    """A day row deleted by hand comes back where it stopped: its counters are never handed out twice."""
    await store.add_tag("order", 10, daily=POLICY)
    await store.next_segment("order@20261128")
    await store.remove_tag("order@20261128")
    assert (await store.next_segment("order@20261128")).segment == Segment(11, 20)


async def test_a_daily_tags_width_and_zone_can_change_and_a_plain_tag_cannot_become_daily(
    store: SegmentStore,
) -> None:
    """set_daily changes the policy of a daily tag only; the day rows go on as they were."""
    await store.add_tag("order", 10, daily=POLICY)
    await store.add_tag("plain", 10)
    await store.next_segment("order@20261128")
    wider = DailyPolicy.checked(8, "UTC")
    assert (await store.set_daily("order", wider)).daily == wider
    assert {i.tag: i.daily for i in await store.list_tags()}["order"] == wider
    assert (await store.next_segment("order@20261128")).segment == Segment(11, 20)
    with pytest.raises(BadRequest, match="not a daily tag"):
        await store.set_daily("plain", wider)
    for name in ("missing", "order@20261128"):
        with pytest.raises(UnknownTag):
            await store.set_daily(name, wider)
