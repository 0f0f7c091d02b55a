"""Two datacenters, segment mode on one PostgreSQL: served at home, across when home has no worker, home again.

Two NATS servers joined by gateways (``dc-a``, ``dc-b``), workers ``a1`` and ``a2`` in ``dc-a`` and ``b1``
in ``dc-b``, each a ``dispenser serve`` child process naming its datacenter (``nats.datacenter``). Who
answered is read from the workers' ``$SRV.STATS`` (the segment endpoint's request count per instance, the
datacenter in the metadata). Every worker of ``dc-a`` is then lost, killed (SIGKILL) or frozen (SIGSTOP:
the server keeps routing to a frozen worker's queue subscription until it drops the silent connection,
after ``ping_interval * (ping_max + 1)`` at most), and brought back; a buffered client in ``dc-a`` draws IDs
through it all. docs/datacenters.md has the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from dispenser.client import BufferSettings, IdClient
from dispenser.config import NatsConfig
from dispenser.messages import RateEvent, Reply
from dispenser_lab.servers import NatsGateways
from tests.ha.cluster_support import _running as running_group

from .segment_support import WorkerProcess, client, ids_of, prepare, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]

PING_INTERVAL = 0.5
PING_MAX = 2
DROPPED_WITHIN = PING_INTERVAL * (PING_MAX + 1)
"""The longest a frozen worker keeps its subscriptions: the server drops a connection that leaves
``ping_max`` PINGs unanswered, one PING every ``ping_interval``."""
_prefixes = itertools.count(1)


@pytest.fixture(scope="module")
def datacenters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsGateways]:
    """``dc-a`` and ``dc-b`` joined by gateways; the servers drop a silent client after 1.5 s at most."""
    yield from running_group(
        NatsGateways(
            tmp_path_factory.mktemp("dc"), ("dc-a", "dc-b"), ping_interval=PING_INTERVAL, ping_max=PING_MAX
        )
    )


class Fleet:
    """The workers of one test: child processes by name (``a1``: datacenter ``dc-a``), one service name."""

    def __init__(self, dcs: NatsGateways, dsn: str, tmp_path: Path, prefix: str) -> None:
        self.dcs = dcs
        self.dsn = dsn
        self.tmp_path = tmp_path
        self.prefix = prefix
        self.service = f"dc-test-{prefix}"
        self.workers: dict[str, WorkerProcess] = {}

    def start(self, name: str) -> None:
        """Start (or start again) worker ``name`` in datacenter ``dc-<name[0]>``."""
        datacenter = f"dc-{name[0]}"
        worker = WorkerProcess(
            self.dcs.url_of(datacenter),
            self.dsn,
            self.tmp_path / f"{name}.log",
            DISPENSER_NATS_DATACENTER=datacenter,
            DISPENSER_NATS_SUBJECT_PREFIX=self.prefix,
            DISPENSER_NATS_SERVICE_NAME=self.service,
            DISPENSER_SNOWFLAKE_ENABLED="false",
            DISPENSER_SEGMENT_STATE_DIR=str(self.tmp_path / name),
            DISPENSER_LOG_LEVEL="INFO",
            DISPENSER_RATE_INTERVAL="0.5",
        )
        worker.start()
        self.workers[name] = worker

    def signal(self, names: list[str], sig: signal.Signals) -> None:
        """Send ``sig`` to each of ``names``."""
        for name in names:
            self.workers[name].signal(sig)

    def bring_back(self, names: list[str], loss: str) -> None:
        """Workers lost to ``loss``: killed ones started again once gone; frozen ones woken, to reconnect.

        (The server dropped the frozen ones' connections.)
        """
        if loss == "killed":
            for name in names:
                self.workers[name].wait()
                self.start(name)
        else:
            self.signal(names, signal.SIGCONT)

    def stop(self) -> None:
        """Stop every worker (a frozen one is woken first, so that SIGTERM can end it)."""
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError, AssertionError):
                worker.signal(signal.SIGCONT)
            worker.stop()

    async def stats(self, nc: Client, expect: int, timeout: float = 30.0) -> dict[str, tuple[str, int]]:
        """Each live instance's (datacenter, segment requests received), once ``expect`` instances answer.

        Raises:
            AssertionError: fewer than ``expect`` instances with a segment endpoint within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            inbox = nc.new_inbox()
            replies: list[dict[str, Any]] = []
            got_all = asyncio.Event()

            async def collect(
                msg: Msg, replies: list[dict[str, Any]] = replies, got_all: asyncio.Event = got_all
            ) -> None:
                if not msg.data:  # the server's "no responders": nobody is there yet
                    return
                replies.append(json.loads(msg.data))
                if len(replies) >= expect:
                    got_all.set()

            sub = await nc.subscribe(inbox, cb=collect)
            await nc.publish(f"$SRV.STATS.{self.service}", b"", reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got_all.wait(), 1.0)
            await sub.unsubscribe()
            found = {
                str(r["id"]): (
                    str(r["metadata"]["datacenter"]),
                    next(e["num_requests"] for e in r["endpoints"] if e["name"] == "segment"),
                )
                for r in replies
                if any(e["name"] == "segment" for e in r["endpoints"])
            }
            if len(found) == expect:
                return found
            for worker in self.workers.values():
                assert worker.proc is not None
                assert worker.proc.poll() is None, f"a worker exited: {worker.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{len(found)} of {expect} workers after {timeout:g} s"
            await asyncio.sleep(0.1)


def answered_by(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Requests received between two STATS readings, per datacenter (instances gone since are not counted)."""
    counts: dict[str, int] = {}
    for instance, (datacenter, received) in after.items():
        counts[datacenter] = counts.get(datacenter, 0) + received - before.get(instance, (datacenter, 0))[1]
    return counts


async def requests(nc: Client, subject: str, n: int) -> list[int]:
    """``n`` requests of 10 IDs, 20 at a time; every one must be answered."""
    ids: list[int] = []
    for first in range(0, n, 20):
        batch = await asyncio.gather(
            *(nc.request(subject, b'{"count": 10}', timeout=5.0) for _ in range(min(20, n - first)))
        )
        ids += [i for m in batch for i in ids_of(msgspec.json.decode(m.data, type=Reply))]
    return ids


async def answered_at_home(nc: Client, fleet: Fleet, subject: str) -> list[int]:
    """200 requests from dc-a, answered at home: none crosses to dc-b. Their IDs.

    Counted from a first reading taken now: a refill the client sent before dc-a's workers were back has
    reached dc-b by then.
    """
    before = await fleet.stats(nc, 3)
    issued = await requests(nc, subject, 200)
    after = await fleet.stats(nc, 3)
    counted = answered_by(before, after)
    assert counted["dc-a"] >= 200
    assert counted["dc-b"] == 0  # home again: none of dc-a's requests crosses
    return issued


async def first_answer_after(nc: Client, subject: str, timeout: float = 20.0) -> tuple[float, int]:
    """Ask every 0.1 s (each with a 0.25 s timeout) until one is answered.

    Returns:
        The seconds it took, and the requests lost (timed out, or "no responders") meanwhile.
    """
    started = time.monotonic()
    lost = 0
    while time.monotonic() - started < timeout:
        try:
            await nc.request(subject, b'{"count": 1}', timeout=0.25)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            lost += 1
            await asyncio.sleep(0.1)
            continue
        return time.monotonic() - started, lost
    raise AssertionError(f"no answer within {timeout:g} s")


@contextlib.asynccontextmanager
async def drawing(url: str, prefix: str, tag: str) -> AsyncIterator[list[int]]:
    """A buffered client in ``dc-a`` drawing IDs all along (about 5,000 a second); every one is collected.

    Raises on leaving if a call failed (a ``DispenserUnavailable`` would surface here).
    """
    # Ranges of ~0.2 s and a 1 s request timeout: the client asks the workers often enough to meet the
    # loss, and a request lost to a frozen worker is sent again (same request_id) soon.
    settings = BufferSettings(buffer_seconds=0.2, min_buffer=50, max_buffer=2_000, request_timeout=1.0)
    ids: list[int] = []
    stop = asyncio.Event()
    config = NatsConfig(url=url, subject_prefix=prefix)
    async with IdClient.over_nats(config, settings) as ids_client:

        async def draw() -> None:
            while not stop.is_set():
                ids.extend(await ids_client.take(tag, 10))
                await asyncio.sleep(0.002)

        task = asyncio.create_task(draw())
        try:
            yield ids
        finally:
            stop.set()
            await task  # re-raises the client's failure, if any


@pytest.mark.parametrize("loss", ["killed", "frozen"])
async def test_callers_are_served_at_home_then_across_then_at_home_again(
    datacenters: NatsGateways, pg_dsn: str, tmp_path: Path, loss: str
) -> None:
    """dc-a's callers are answered at home, across while dc-a has no worker, and at home again.

    Only by dc-a while it has a worker; by dc-b once all of dc-a's are lost (killed, or frozen until the
    server drops them), within the caller's timeout; by dc-a again once they are back. A buffered client in
    dc-a draws IDs throughout without an error, none twice.
    """
    prefix = f"dc{next(_prefixes)}{loss[0]}"
    tag = f"order_{loss}"
    await prepare(pg_dsn, [(tag, 1000)])
    subject = f"{prefix}.segment.{tag}"
    fleet = Fleet(datacenters, pg_dsn, tmp_path, prefix)
    try:
        for name in ("a1", "a2", "b1"):
            fleet.start(name)
        async with client(datacenters.url_of("dc-a")) as a, client(datacenters.url_of("dc-b")) as b:
            events: list[RateEvent] = []

            async def heard(msg: Msg) -> None:
                events.append(msgspec.json.decode(msg.data, type=RateEvent))

            await a.subscribe(f"{prefix}.rate.>", cb=heard)  # from both datacenters, across the gateway
            before = await fleet.stats(a, 3)
            issued = await requests(a, subject, 200)
            issued += await requests(b, subject, 100)
            after = await fleet.stats(a, 3)
            assert answered_by(before, after) == {"dc-a": 200, "dc-b": 100}  # each at home

            async with drawing(datacenters.url_of("dc-a"), prefix, tag) as drawn:
                await wait_until(lambda: bool(drawn), what="the buffered client drawing")
                before = await fleet.stats(a, 3)
                fleet.signal(["a1", "a2"], signal.SIGKILL if loss == "killed" else signal.SIGSTOP)
                took, lost = await first_answer_after(a, subject)
                issued += await requests(a, subject, 200)
                after = await fleet.stats(a, 1)
                assert set(after) == {i for i, (dc, _) in before.items() if dc == "dc-b"}
                assert answered_by(before, after)["dc-b"] >= 200 + 1  # and the client's refills
                print(f"{loss}: dc-a's callers answered by dc-b after {took:.3f} s ({lost} requests lost)")
                if loss == "killed":
                    assert took < 1.0  # the server removes a closed connection's interest at once
                else:
                    assert took < DROPPED_WITHIN + 2.0

                fleet.bring_back(["a1", "a2"], loss)
                back = time.monotonic()
                await fleet.stats(a, 3)
                home = time.monotonic() - back
                issued += await answered_at_home(a, fleet, subject)
                print(f"{loss}: dc-a's workers serving again {home:.2f} s after their restart/SIGCONT")
                drawn_now = len(drawn)
                await wait_until(lambda: len(drawn) >= drawn_now + 1000, what="the client drawing on")
            # Each worker's rate events name its datacenter: `dispenser watch` shows each and the fleet.
            await wait_until(
                lambda: {(e.datacenter, e.tag) for e in events} >= {("dc-a", tag), ("dc-b", tag)},
                what="rate events from both datacenters",
            )
        print(f"{loss}: the buffered client drew {len(drawn):,} IDs")
        everything = issued + drawn
        assert len(set(everything)) == len(everything), "an ID was handed out twice"
    finally:
        fleet.stop()
