"""The status page: its snapshot is the worker's state, and its HTML escapes whatever it shows."""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

import msgspec

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.core.errors import StoreUnavailable
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import RateEvent
from dispenser.ports import WorkerLease
from dispenser.service.dispatch import Dispatcher
from dispenser.service.rates import RateBook
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.status import ClockCheck, RecentErrors, StatusPage, WorkerStatus, worker_status
from dispenser.status.errors import LoggedError
from dispenser.status.page import CONTENT_SECURITY_POLICY, render_page
from dispenser.status.snapshot import PeerStatus, SegmentRun, SegmentTag, SnowflakeStatus, SnowflakeTag
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemorySegmentStore
from tests.unit.metrics_support import rate_book


@dataclass
class Sources:
    """What the snapshot reads of a worker (the worker's is ``dispenser.app.operations.Observed``)."""

    clock: ManualClock
    rates: RateBook
    allocator: SegmentAllocator | None = None
    snowflake: SnowflakeGenerator | None = None
    dispatchers: dict[str, Dispatcher] = field(default_factory=dict)


async def _no_persist(_worker_id: int, _high_water_ms: int) -> None:
    return None


async def segment_sources(clock: ManualClock, step: int = 100) -> Sources:
    """A worker's segment side over the memory store: tag ``order`` of ``step``, sized by its rate book."""
    rates = rate_book(clock)
    store = MemorySegmentStore()
    await store.add_tag("order", step)
    allocator = SegmentAllocator(
        store, clock, AllocatorSettings(), sizer=rates.size, meters=rates.segment_meter
    )
    await allocator.refresh()
    return Sources(clock, rates, allocator)


async def test_a_segment_tag_shows_its_buffers_step_and_why_from_the_allocator() -> None:
    """30 IDs of a step of 100: the segment 1-100 at 31, the next one as sized (and why), all read from the allocator."""
    clock = ManualClock()
    sources = await segment_sources(clock)
    assert sources.allocator is not None
    await sources.allocator.take("order", 30, clock.monotonic() + 1)
    await settle()  # the next segment, fetched at the switch (sized by the burst: 30 IDs at once)
    status = worker_status(sources)
    (tag,) = status.segments
    tag_allocator = sources.allocator.tags["order"]
    next_step, why = sources.rates.sizing(tag_allocator)
    assert (tag.tag, tag.step, tag.configured_step) == ("order", tag_allocator.last_step, 100)
    assert (tag.next_step, tag.why) == (next_step, why)
    assert tag.why in ("floor", "cap", "kept", "sized")
    step = tag.step
    assert step is not None
    assert tag.current == SegmentRun(first=1, last=100, next=31, left=70)
    assert tag.queued == [SegmentRun(first=101, last=100 + step, next=101, left=step)]
    assert tag.ids_buffered == tag_allocator.buffer.remaining == 70 + step
    assert tag.ids_total == 30
    assert tag.fetches == tag_allocator.fetches == 2
    assert tag.last_error is None
    assert status.worker == sources.rates.worker
    assert status.snowflake is None
    await sources.allocator.close()


async def test_the_peers_events_and_a_fetch_error_show_on_the_tag() -> None:
    """A peer's last rate event is listed with its datacenter; a failed fetch shows its code and message."""
    clock = ManualClock()
    sources = await segment_sources(clock)
    assert sources.allocator is not None
    await sources.allocator.take("order", 1, clock.monotonic() + 1)
    sources.rates.observe(
        RateEvent(
            tag="order",
            kind="segment",
            worker="peer-1",
            time=clock.wall_ms() / 1000 - 2,
            window_s=60,
            ids_per_s=12.5,
            requests_per_s=1.0,
            peak_ids_per_s=20.0,
            step=500,
            ids_buffered=700,
            runway_s=35.0,
            datacenter="eu",
        )
    )
    sources.allocator.tags["order"].last_error = StoreUnavailable("PostgreSQL is down")
    (tag,) = worker_status(sources).segments
    assert tag.peers == [
        PeerStatus(
            worker="peer-1",
            datacenter="eu",
            ids_per_s=12.5,
            peak_ids_per_s=20.0,
            step=500,
            ids_buffered=700,
            runway_s=35.0,
            age_s=2.0,
        )
    ]
    assert tag.last_error == "unavailable: segment store unavailable: PostgreSQL is down"
    await sources.allocator.close()


async def test_the_snowflake_side_shows_its_worker_id_lease_clock_offset_and_tags() -> None:
    """Worker ID 5, the lease held, the clock offset the peer check found, the tags it served."""
    clock = ManualClock()
    registry = StaticRegistry(5, max_worker_id=SnowflakeLayout().max_worker_id)
    await registry.register()
    generator = SnowflakeGenerator(
        SnowflakeLayout(), WorkerLease(5, 0), registry, clock, _no_persist, settings=SnowflakeSettings()
    )
    await generator.start()
    rates = rate_book(clock)
    generator.on_issue = lambda tag, count: rates.record("snowflake", tag, count)
    await generator.take("invoice", 3, clock.monotonic() + 1)
    check = ClockCheck(offset_ms=-1.25, peers=2, at_ms=clock.wall_ms())
    status = worker_status(
        Sources(clock, rates, snowflake=generator), clock_check=check, snowflake_mode="static"
    )
    snowflake = status.snowflake
    assert snowflake is not None
    assert (snowflake.worker_id, snowflake.mode, snowflake.holds_lease) == (5, "static", True)
    assert (snowflake.clock_offset_ms, snowflake.clock_peers) == (-1.2, 2)
    assert snowflake.reserved_ms == generator.reserved_ms
    assert snowflake.layout == "41+0+10+12 bits from 1288834974657 ms"
    assert [(t.tag, t.ids_total) for t in snowflake.tags] == [("invoice", 3)]
    await generator.stop()


def test_recent_errors_keep_the_last_warnings_newest_first_and_stop_when_detached() -> None:
    """WARNING and above, formatted, the exception's type named, bounded; nothing after detach."""
    errors = RecentErrors(size=2)
    errors.attach("dispenser.test_status")
    log = logging.getLogger("dispenser.test_status.part")
    log.info("not kept")
    log.warning("first %d", 1)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("second")
    log.error("third <b>")
    errors.detach()
    log.error("after")
    assert [(line.level, line.message) for line in errors.lines()] == [
        ("ERROR", "third <b>"),
        ("ERROR", "second (ValueError)"),
    ]
    assert errors.lines()[0].logger == "dispenser.test_status.part"


HOSTILE = '<script>alert("x")</script>&"\'<img src=x onerror=alert(1)>'


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def hostile_status() -> WorkerStatus:
    """A snapshot with a hostile string in every text it shows."""
    run = SegmentRun(first=1, last=10, next=2, left=9)
    peer = PeerStatus(
        worker=HOSTILE,
        datacenter=HOSTILE,
        ids_per_s=1.0,
        peak_ids_per_s=1.0,
        step=10,
        ids_buffered=5,
        runway_s=None,
        age_s=1.0,
    )
    segment = SegmentTag(
        tag=HOSTILE,
        step=10,
        configured_step=10,
        next_step=10,
        why="floor",
        why_detail=HOSTILE,
        ids_buffered=9,
        current=run,
        queued=[],
        fetching=False,
        stride=1,
        fetches=1,
        fetch_errors=0,
        fetches_per_min=1.0,
        ids_per_s=0.0,
        peak_ids_per_s=0.0,
        ids_total=1,
        runway_s=None,
        peers=[peer],
        last_error=HOSTILE,
    )
    snowflake = SnowflakeStatus(
        worker_id=1,
        datacenter_id=0,
        mode=HOSTILE,
        holds_lease=True,
        reserved_ms=0,
        clock_offset_ms=None,
        clock_peers=0,
        clock_checked_ms=None,
        clock_waits=0,
        clock_back_waits=0,
        rollbacks_refused=0,
        refusal=HOSTILE,
        layout=HOSTILE,
        tags=[SnowflakeTag(tag=HOSTILE, ids_per_s=0.0, peak_ids_per_s=0.0, ids_total=1, peers=[peer])],
    )
    return WorkerStatus(
        worker=HOSTILE,
        datacenter=HOSTILE,
        version=HOSTILE,
        at_ms=0,
        not_ready=[HOSTILE],
        cannot_issue=[HOSTILE],
        segments=[segment],
        snowflake=snowflake,
        errors=[],
        recent_errors=[LoggedError(at_ms=0, level="ERROR", logger=HOSTILE, message=HOSTILE)],
    )


def test_hostile_names_and_messages_are_shown_as_text_never_as_markup() -> None:
    """Tag names, worker names, log lines with markup: escaped; the page's one script is its own."""
    page = render_page(hostile_status())
    elements = _Elements()
    elements.feed(page)
    assert "img" not in elements.tags
    assert elements.tags.count("script") == 1
    assert "alert" not in "".join(elements.scripts)
    assert "<script>alert" not in page
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&quot;&#x27;&lt;img") >= 10


def test_the_pages_policy_allows_its_own_style_and_script_only() -> None:
    """The CSP names the hashes of the page's inline style and script, and no other source."""
    page = render_page(hostile_status())
    for element in ("style", "script"):
        match = re.search(f"<{element}>(.*?)</{element}>", page, re.DOTALL)
        assert match is not None
        digest = base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode()
        assert f"{element}-src 'sha256-{digest}'" in CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "http" not in CONTENT_SECURITY_POLICY


async def test_the_json_is_the_snapshot_and_the_page_shows_it() -> None:
    """/status.json decodes to the snapshot; /status shows the tag's step with its exact value."""
    clock = ManualClock()
    sources = await segment_sources(clock, step=250)
    assert sources.allocator is not None
    await sources.allocator.take("order", 5, clock.monotonic() + 1)
    page = StatusPage(sources, not_ready=lambda: ["NATS is not connected"])
    status = msgspec.json.decode(page.json(), type=WorkerStatus)
    assert status.not_ready == ["NATS is not connected"]
    assert status.segments[0].step == 250
    html = page.html()
    assert '<td data-field="step" data-value="250" class="n">250</td>' in html
    assert "not ready" in html
    await sources.allocator.close()
