"""Rate events and the adaptive step against real NATS and PostgreSQL, with time scaled by segment_seconds.

Each test runs workers in this event loop with ``segment_seconds`` S = 2 s and 1-second rate windows, drives a
paced load of R IDs/s, and checks the bars of the issue: the step of new segments near S x R, one database
round trip per S seconds, a rise followed within two segments, two workers sizing to their shares, the
runway, a restart that starts from the saved peak, the events against their schema, `watch --once` and
`/metrics`.

Two tests pace real seconds end to end (the steady load, with events, `watch` and `/metrics`; the runway,
which needs PostgreSQL's outage to take real time). The others run the workers on a
:class:`~dispenser.testing.clock.ManualClock` (:func:`paced`): requests and segment fetches go over the real
servers, but the rates, windows, events and steps are measured in virtual seconds that move only between
requests. A database round trip then takes no virtual time, so each test takes a second or so and its
figures no longer depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import statistics
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import msgspec
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from dispenser.app import Worker
from dispenser.config import Config, load_config
from dispenser.messages import RateEvent, Reply
from dispenser.testing.clock import ManualClock
from dispenser.watch import run_watch
from dispenser_lab.servers import NatsServer, PostgresServer, frozen

from .segment_support import client, prepare, request, running_worker, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]

S = 2.0
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "rate-event.schema.json").read_text())


def rate_config(nats_url: str, dsn: str, **extra: object) -> Config:
    """Fast rates: events every 0.5 s, 1 s windows, segments of S seconds, metrics on a free port."""
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_RATE_INTERVAL": "0.5",
        "DISPENSER_RATE_WINDOW": "1",
        "DISPENSER_RATE_SEGMENT_SECONDS": str(S),
        "DISPENSER_RATE_STALE_AFTER": "3",
        "DISPENSER_RATE_PERSIST_INTERVAL": "0.5",
        "DISPENSER_METRICS_PORT": "0",
    }
    env |= {f"DISPENSER_{k.upper()}": str(v) for k, v in extra.items()}
    return load_config(environ=env)


async def load(nc: Client, rate: float, seconds: float, per_request: int = 100) -> list[int]:
    """Ask for ``rate`` IDs/s of tag ``order`` for ``seconds``, ``per_request`` at a time, paced; the IDs."""
    ids: list[int] = []
    interval = per_request / rate
    start = time.monotonic()
    n = 0
    body = msgspec.json.encode({"count": per_request, "format": "ranges"})
    while (due := start + n * interval) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        ids += _ids_of((await request(nc, "leaf.segment.order", body)).data)
        n += 1
    return ids


def _ids_of(msg_data: bytes) -> list[int]:
    reply = msgspec.json.decode(msg_data, type=Reply)
    assert reply.error is None, reply.error
    assert reply.ranges is not None
    return [i for first, last in reply.ranges for i in range(first, last + 1)]


async def paced(
    nc: Client,
    clock: ManualClock,
    workers: list[Worker],
    rate: float,
    seconds: float,
    *,
    per_request: int = 100,
) -> list[int]:
    """:func:`load` on virtual time: ``rate`` IDs/s of ``clock``'s seconds for ``seconds`` of them; the IDs.

    ``per_request`` IDs a request (100, as :func:`load` asks by default).

    After each reply the segment fetches it set off are let finish before the clock moves on: a round trip
    to PostgreSQL takes no virtual time (in real time it takes a few milliseconds of S = 2 s).
    """
    ids: list[int] = []
    interval = per_request / rate
    body = msgspec.json.encode({"count": per_request, "format": "ranges"})

    def fetching() -> bool:
        return any(tag.buffer.fetching for worker in workers for tag in worker.allocator.tags.values())

    for _ in range(round(seconds / interval)):
        ids += _ids_of((await request(nc, "leaf.segment.order", body)).data)
        await wait_until(lambda: not fetching(), what="the segment fetches under way")
        await clock.advance(interval)
    return ids


@contextlib.asynccontextmanager
async def events(nc: Client) -> AsyncIterator[list[RateEvent]]:
    """Every rate event of tag ``order`` while inside, each validated against the published schema."""
    seen: list[RateEvent] = []

    async def received(msg: object) -> None:
        raw = json.loads(msg.data)  # type: ignore[attr-defined]
        jsonschema.validate(raw, SCHEMA)
        seen.append(msgspec.convert(raw, RateEvent))

    sub = await nc.subscribe("leaf.rate.order", cb=received)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


def scrape(port: int) -> str:
    """GET /metrics (blocking: call it from a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text: str = page.read().decode()
    return text


def order(worker: Worker) -> object:
    return worker.allocator.tags["order"]


async def test_steady_load_sizes_segments_to_s_times_r(nats_server: NatsServer, pg_dsn: str) -> None:
    """R = 2,000 IDs/s: new segments hold S x R (±25%), one fetch per S seconds; events, watch, /metrics agree."""
    rate = 2000.0
    await prepare(pg_dsn, [("order", 100)])
    config = rate_config(nats_server.url, pg_dsn)
    async with running_worker(config) as worker, client(nats_server.url) as nc, events(nc) as seen:
        started = time.monotonic()
        ids = await load(nc, rate, 5.0)  # warm-up: the first segments are the floor's size
        tag = worker.allocator.tags["order"]
        fetches_before = tag.fetches
        ids += await load(nc, rate, 6.0)
        during = list(seen)  # events published under load (after it, the 1 s windows empty out)
        steady_fetches = tag.fetches - fetches_before
        out = io.StringIO()
        await run_watch(config, once=True, out=out)
        # The worker is younger than a minute: its fetches per minute are all of them over its age.
        fetches_per_min = tag.fetches * 60 / (time.monotonic() - started)
        # The server runs in this loop: fetch from a thread, or the blocking read would wait for ever.
        metrics = await asyncio.to_thread(scrape, worker.metrics.port)
    steps = list(tag.steps)[-3:]
    assert all(0.75 * S * rate <= step <= 1.25 * S * rate for step in steps), steps
    assert 1 <= steady_fetches <= 2 * 6.0 / S, steady_fetches  # about one round trip per S seconds
    assert len(set(ids)) == len(ids)
    assert len(during) >= 10
    last = during[-2]  # the last one may straddle the end of the load
    assert last.kind == "segment"
    assert 0.75 * rate <= last.ids_per_s <= 1.25 * rate
    assert 0.75 * rate <= last.peak_ids_per_s <= 1.25 * rate
    assert last.runway_s is not None
    assert last.runway_s == pytest.approx(last.ids_buffered / last.peak_ids_per_s, rel=0.05)
    table = out.getvalue()
    row = next(line for line in table.splitlines() if line.startswith("order"))
    assert row.split()[1:3] == ["segment", "1"]
    # One listening interval saw one event: the figure is the worker's own, not 0.0.
    assert float(row.split()[-1]) == pytest.approx(fetches_per_min, rel=0.25), (table, tag.fetches)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    [issued] = [
        s.value for s in families["leaf_ids"].samples if s.labels == {"kind": "segment", "tag": "order"}
    ]
    assert issued == len(ids)  # the counter matches the IDs handed out
    assert any(s.value == steps[-1] for s in families["leaf_segment_step"].samples)
    assert families["leaf_request_seconds"].type == "histogram"


async def test_a_tenfold_rise_is_followed_within_two_segments(nats_server: NatsServer, pg_dsn: str) -> None:
    """R to 10 R: within two fetches segments are S x 10 R (±25%), and no request waits for a segment.

    Every request is answered from the buffer, as at steady load: the next segment is fetched before the
    one in hand runs out. (Virtual time: see :func:`paced`.)
    """
    rate = 500.0
    await prepare(pg_dsn, [("order", 100)])
    clock = ManualClock()
    config = rate_config(nats_server.url, pg_dsn)
    async with running_worker(config, clock) as worker, client(nats_server.url) as nc:
        await paced(nc, clock, [worker], rate, 5.0)
        tag = worker.allocator.tags["order"]
        dispatcher = worker.dispatchers["segment"]
        before, waited_before, inline_before = tag.fetches, sum(dispatcher.waited), dispatcher.inline
        await paced(nc, clock, [worker], 10 * rate, 3.0)
        after = list(tag.steps)[-(tag.fetches - before) :]
        assert sum(dispatcher.waited) == waited_before
        assert dispatcher.inline - inline_before >= 10 * rate * 3.0 / 100 * 0.9
    assert len(after) >= 3, after
    assert any(0.75 * S * 10 * rate <= step <= 1.25 * S * 10 * rate for step in after[:2]), after
    assert all(step <= 1.25 * S * 10 * rate for step in after), after


async def test_two_workers_size_to_their_shares(nats_server: NatsServer, pg_dsn: str) -> None:
    """Two workers share 3,000 IDs/s: each sizes to its share; the sum of their steps is S x R (±25%).

    (Virtual time, one clock for both: see :func:`paced`.)
    """
    rate = 3000.0
    await prepare(pg_dsn, [("order", 100)])
    config = rate_config(nats_server.url, pg_dsn)
    clock = ManualClock()
    async with (
        running_worker(config, clock) as first,
        running_worker(config, clock) as second,
        client(nats_server.url) as nc,
    ):
        # One paced stream of R: the queue group splits it between the two workers, at random per request.
        # 20 IDs a request (150 requests/s), not 100: with 30 requests/s the split of one 1-s window swung
        # by +-9% (binomial), the peaks and the steps with it, and the sum of steps reached 1.32 x S x peak
        # in CI (1.27 in 12 runs here); at 150/s twelve runs gave 1.01-1.19 (the band's middle is 1.12).
        await paced(nc, clock, [first, second], rate, 8.0, per_request=20)
        # Each worker's typical step: the median of its last three fetches. A single fetch's size follows
        # the rate of the moment it was made at (the queue group's split jitters, and the load generator
        # catches up in bursts on a busy machine), which put one step alone 55% over its share in CI.
        steps = [
            int(statistics.median(list(order(w).steps)[-3:]))  # type: ignore[attr-defined]
            for w in (first, second)
        ]
        now = first.clock.monotonic()
        fleet_peak = sum(w.rates.meter("segment", "order").peak(now) for w in (first, second))
        assert first.rates.peers("segment", "order")  # each hears the other
        assert second.rates.peers("segment", "order")
    assert all(step is not None and step > 100 for step in steps), steps
    # The bar: the steps add up to S x the fleet's peak (the peak, a maximum of 1 s averages, runs a little
    # above the offered rate as the queue group's split jitters).
    assert 0.75 * S * fleet_peak <= sum(steps) <= 1.25 * S * fleet_peak, (steps, fleet_peak)
    # Against the nominal rate: steps are 1-1.25 x their target, which uses the measured peak, and that
    # ran up to ~30% above the nominal rate on a loaded machine (9,740 for S x R = 6,000 was seen).
    assert 0.75 * S * rate <= sum(steps) <= 1.8 * S * rate, steps


async def test_the_database_gone_at_the_worst_moment_leaves_s_seconds_of_ids(
    private_postgres: PostgresServer, nats_server: NatsServer
) -> None:
    """At steady load, PostgreSQL freezes just before a switch: IDs keep coming for S seconds, as reported.

    The worst moment for the runway: the current segment is nearly used up and the next one, fetched at
    the last switch, is all there is; the fetch the coming switch sets off cannot succeed. With Leaf's 10%
    prefetch, or a step the hysteresis held under its target, this was 0.73-0.95 x S.
    """
    rate = 2000.0
    dsn = private_postgres.dsn
    await prepare(dsn, [("order", 100)])
    config = rate_config(nats_server.url, dsn, segment_fetch_deadline=0.2, postgres_command_timeout=0.5)
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        await load(nc, rate, 4.0)
        tag = worker.allocator.tags["order"]
        steady = asyncio.create_task(load(nc, rate, 60.0))
        try:
            # At every moment (sampled every 5 ms for 2 S) but a fetch's round trip, a whole segment is in
            # hand: with Leaf's 10% prefetch the low point is 0.9 of a segment, with no fetch under way.
            # (The round trip itself is milliseconds against S = 600 s in production, but up to a few
            # hundred here on a loaded machine against S = 2 s: 0.84 was seen with fetches counted.)
            low, until = float("inf"), time.monotonic() + 2 * S
            while time.monotonic() < until:
                stats = tag.buffer.stats()
                if stats.current is not None and not stats.fetching:
                    size = stats.current.last - stats.current.first + 1
                    low = min(low, stats.remaining / size)
                await asyncio.sleep(0.005)
            assert low >= 0.97, f"at one moment only {low:.2f} of a segment was in hand"

            def just_before_a_switch() -> bool:
                stats = tag.buffer.stats()
                current = stats.current
                return (
                    current is not None
                    and len(stats.next) == 1
                    and not stats.fetching
                    and current.remaining < 0.03 * (current.last - current.first + 1)
                )

            await wait_until(just_before_a_switch, timeout=3 * S, what="the moment just before a switch")
            now = worker.clock.monotonic()
            held = tag.buffer.remaining
            reported = held / max(tag.meter.peak(now), tag.meter.rate(now))
            assert private_postgres.pid is not None
            with frozen(private_postgres.pid):  # PostgreSQL stopped dead, at once; resumed afterwards
                frozen_at = time.monotonic()
                with contextlib.suppress(AssertionError):  # the first error reply ends the load
                    await steady
                lasted = time.monotonic() - frozen_at - config.segment.fetch_deadline
        finally:
            steady.cancel()
            await asyncio.gather(steady, return_exceptions=True)
    print(
        f"low point {low:.3f} of a segment; at the worst moment held {held} IDs, {reported:.2f} s reported;"
    )
    print(f"lasted {lasted:.2f} s (S = {S:g} s)")
    # A whole segment of at least S x R is in hand; the load's pacing may run a little ahead of R.
    assert lasted >= 0.95 * S, (lasted, reported, held)
    assert reported >= S, (reported, held)
    assert abs(lasted - reported) <= 0.2 * reported, (lasted, reported)


async def test_a_restart_at_peak_starts_from_the_saved_peak(nats_server: NatsServer, pg_dsn: str) -> None:
    """The peak is saved in PostgreSQL: a restarted worker's first segment is already S x R (±25%).

    (Virtual time: see :func:`paced`.)
    """
    rate = 2000.0
    await prepare(pg_dsn, [("order", 100)])
    # The stopped worker's unused rest, given back (segment.return_unused), would be the restarted one's first
    # segment: off, so that its first fetch is the sized one this test is about.
    config = rate_config(nats_server.url, pg_dsn, segment_return_unused="false")
    clock = ManualClock()
    async with client(nats_server.url) as nc:
        async with running_worker(config, clock) as worker:
            await paced(nc, clock, [worker], rate, 4.0)
        async with running_worker(config, clock) as restarted:
            await paced(nc, clock, [restarted], rate, 0.2)
            first = next(iter(order(restarted).steps))  # type: ignore[attr-defined]
    assert 0.75 * S * rate <= first <= 1.25 * S * rate, first


async def test_two_workers_restarted_as_one_start_from_the_fleets_peak(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Two workers share R; both stop; one starts alone: its first segment is S x R (±25%), not S x R/2.

    The saved peak is the fleet's (the live workers' peaks summed), one row per tag in PostgreSQL: before
    it was each worker's own, the last writer won, and the restarted one sized from half the demand.
    (Virtual time: see :func:`paced`.)
    """
    rate = 3000.0
    await prepare(pg_dsn, [("order", 100)])
    config = rate_config(nats_server.url, pg_dsn, segment_return_unused="false")  # as in the test above
    clock = ManualClock()
    async with client(nats_server.url) as nc:
        async with running_worker(config, clock) as a, running_worker(config, clock) as b:
            await paced(nc, clock, [a, b], rate, 6.0)
            assert a.rates.peers("segment", "order")  # each hears the other
            own_peaks = [w.rates.meter("segment", "order").peak(clock.monotonic()) for w in (a, b)]
        async with running_worker(config, clock) as alone:
            await paced(nc, clock, [alone], rate, 0.2)
            first = next(iter(order(alone).steps))  # type: ignore[attr-defined]
    assert all(peak < 0.8 * rate for peak in own_peaks), own_peaks  # each worker alone saw about half
    assert 0.75 * S * rate <= first <= 1.25 * S * sum(own_peaks), (first, own_peaks)
