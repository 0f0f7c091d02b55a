"""Daily tags end to end: real NATS and PostgreSQL, workers whose clocks cross a (shifted) midnight."""

from __future__ import annotations

import asyncio
from datetime import datetime
from zoneinfo import ZoneInfo

import aiohttp
import pytest

from dispenser.cli import main
from dispenser.client import BufferSettings, IdClient
from dispenser.config import Config, load_config
from dispenser.core.daily import day_of, split
from dispenser.ports import SystemClock
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, ids_of, running_worker
from .snowflake_support import ShiftableClock

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

SHANGHAI = ZoneInfo("Asia/Shanghai")
MIDNIGHT_MS = int(datetime.fromisoformat("2026-11-28T00:00:00+08:00").timestamp() * 1000)


def config(nats_url: str, dsn: str, prefix: str = "leaf", **extra: str) -> Config:
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
    }
    return load_config(environ=env | extra)


def before_midnight(ms: int) -> ShiftableClock:
    """The real clock, its wall time ``ms`` before 2026-11-28 00:00 in Shanghai."""
    return ShiftableClock(MIDNIGHT_MS - ms - SystemClock().wall_ms())


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, list(args))


async def test_two_workers_a_second_apart_across_midnight_share_each_days_counter(
    nats_server: NatsServer, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A crosses midnight a second before B: each ID carries its worker's date, and none repeats."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert (
        await cli(
            "tag", "add", "order", "--step", "5", "--daily", "--width", "6", "--time-zone", "Asia/Shanghai"
        )
        == 0
    )
    ahead, behind = before_midnight(300), before_midnight(1300)
    seen: list[int] = []
    by_day: dict[int, list[int]] = {}
    async with (
        running_worker(config(nats_server.url, pg_dsn, "a"), ahead),
        running_worker(config(nats_server.url, pg_dsn, "b"), behind),
        client(nats_server.url) as nc,
    ):
        while behind.wall_ms() < MIDNIGHT_MS + 200:  # ~1.5 s: A past midnight first, then B
            for prefix, clock in (("a", ahead), ("b", behind)):
                before = day_of(clock.wall_ms(), SHANGHAI)
                got = ids_of(await ask(nc, f"{prefix}.segment.order", b'{"count": 3}'))
                after = day_of(clock.wall_ms(), SHANGHAI)
                day = split(got[0], 6)[0]
                assert day in {before, after}, (prefix, got, before, after)
                assert got == sorted(got)
                assert {split(i, 6)[0] for i in got} == {day}  # a batch is of one day
                seen += got
                by_day.setdefault(day, []).extend(got)
            await asyncio.sleep(0.03)
    assert len(seen) == len(set(seen))
    assert set(by_day) == {20261127, 20261128}
    assert min(by_day[20261128]) == 20261128000001  # the new day's counter starts at 1
    # The workers drew each day from one shared row: together, a day's counters leave no ID twice.
    assert all(len(day) == len(set(day)) for day in by_day.values())


async def test_a_days_counter_runs_out_of_digits_over_nats_http_and_the_client(
    nats_server: NatsServer, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Width 1: nine IDs a day, the same over NATS, Leaf's HTTP API and the buffered client; then day_exhausted."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "few", "--step", "2", "--daily", "--width", "1") == 0
    assert "(e.g. 202611281)" in capsys.readouterr().out
    assert await cli("tag", "list") == 0
    assert "[daily: width 1, UTC]" in capsys.readouterr().out
    clock = ShiftableClock(MIDNIGHT_MS + 9 * 3_600_000 - SystemClock().wall_ms())  # 2026-11-28 01:00 UTC
    async with (
        running_worker(config(nats_server.url, pg_dsn, DISPENSER_HTTP_PORT="0"), clock) as worker,
        client(nats_server.url) as nc,
    ):
        assert ids_of(await ask(nc, "leaf.segment.few", b'{"count": 4}')) == [
            202611281,
            202611282,
            202611283,
            202611284,
        ]
        assert worker.http is not None
        async with (
            aiohttp.ClientSession(worker.http.url) as session,
            session.get("/api/segment/get/few") as response,
        ):
            assert (response.status, await response.text()) == (200, "202611285")
        # The client asks for ranges of its buffer's size (2 here): a request past the day's last counter
        # would be refused whole.
        async with IdClient.over_nats(nats_server.url, BufferSettings(min_buffer=2, max_buffer=2)) as ids:
            assert await ids.next_id("few") == 202611286
        reply = await ask(nc, "leaf.segment.few", b'{"count": 4}')
        assert reply.error is not None
        assert (reply.error.code, reply.error.retryable) == ("day_exhausted", False)
        assert "9 IDs of 20261128" in reply.error.message
        async with (
            aiohttp.ClientSession(worker.http.url) as session,
            session.get("/api/segment/get/few") as response,
        ):
            assert response.status == 500  # Leaf's answer to any failure, as Leaf's callers expect
            assert response.headers["Dispenser-Error-Code"] == "day_exhausted"


async def test_tag_set_changes_a_daily_tags_width_and_zone_only(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tag set --width/--time-zone` on a daily tag; a plain or unknown tag is refused with the reason."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "order", "--step", "5", "--daily", "--time-zone", "Asia/Shanghai") == 0
    assert await cli("tag", "add", "plain", "--step", "5") == 0
    capsys.readouterr()
    assert await cli("tag", "set", "order", "--width", "8") == 0
    assert "width 8, zone Asia/Shanghai" in capsys.readouterr().out
    assert await cli("tag", "set", "order", "--time-zone", "UTC", "--step", "7") == 0
    assert await cli("tag", "list") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("order"))
    assert row.split()[2:6] == ["7", "[daily:", "width", "8,"]
    assert "UTC]" in row
    assert await cli("tag", "set", "plain", "--width", "8") == 1
    assert "not a daily tag" in capsys.readouterr().err
    assert await cli("tag", "set", "nope", "--width", "8") == 1
    assert "unknown tag" in capsys.readouterr().err
