"""What a PostgreSQL failover costs the dispenser: kill -9 the Patroni leader under load, measure, print a table.

For each setting (replication mode, ZooKeeper session cap), a fresh 3-node Patroni cluster, a NATS server and
one worker (in this process) serve four NATS requesters, two on a tag whose segments hold far more than a
failover consumes (``buffered``) and two on a tag whose 50-ID segments run dry at once (``dry``). The leader's
whole process tree is killed ``--kills`` times (the killed node rejoins from a fresh copy between kills).

Per kill: seconds until Patroni has a writable leader; seconds until ``dry`` answers again after its last
``unavailable`` (what a client with empty buffers waits); ``unavailable`` replies and request
timeouts of each tag; the longest stall of ``buffered`` requesters; duplicate IDs (must be 0).

Usage: python lab/ha/pg_failover.py [--kills 2] [--settings strict:6000,strict:none,async:6000,async:none]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.config import load_config
from dispenser.messages import Reply
from dispenser.tables import render_table
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.patroni import PatroniCluster


@dataclass
class Seen:
    """What the requesters of one tag saw."""

    ok: list[tuple[float, float]] = field(default_factory=list)
    """(sent, answered) monotonic times of each success."""
    ids: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    error_times: list[float] = field(default_factory=list)
    timeouts: int = 0


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` every 10 ms until it holds."""
    while True:
        if condition():
            return
        await asyncio.sleep(0.01)


async def requester(nc: Client, tag: str, seen: Seen, stop: asyncio.Event) -> None:
    """Ask ``leaf.segment.<tag>`` for 10 IDs at a time until ``stop``, recording what comes back."""
    body = b'{"count": 10}'
    while not stop.is_set():
        sent = time.monotonic()
        try:
            msg = await nc.request(f"leaf.segment.{tag}", body, timeout=3.0)
        except nats.errors.TimeoutError:
            seen.timeouts += 1
            continue
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.01)
            continue
        reply = msgspec.json.decode(msg.data, type=Reply)
        if reply.error is not None:
            seen.errors[reply.error.code] += 1
            seen.error_times.append(time.monotonic())
            await asyncio.sleep(0.01)
            continue
        seen.ids.extend(reply.ids or [])
        seen.ok.append((sent, time.monotonic()))


async def one_setting(
    mode: str, cap: int | None, kills: int, workdir: Path, nats_url: str
) -> list[list[str]]:
    """Run ``kills`` failovers on a fresh cluster with this setting; one table row per kill."""
    cluster = PatroniCluster(workdir, synchronous=mode, session_cap_ms=cap)
    rows = []
    try:
        await asyncio.to_thread(cluster.start)
        dsn = cluster.dsn_for("postgres")
        await migrate(dsn)
        async with await PostgresSegmentStore.connect(dsn) as store:
            await store.add_tag("buffered", 5_000_000)
            await store.add_tag("dry", 50)
        env = {
            "DISPENSER_NATS_URL": nats_url,
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_SEGMENT_FETCH_DEADLINE": "1.0",
            "DISPENSER_SEGMENT_STATE_DIR": str(workdir / "state"),
            "DISPENSER_RATE_ADAPTIVE_STEP": "false",
        }
        worker = Worker(load_config(environ=env))
        await worker.start()
        nc = await nats.connect(nats_url)
        try:
            for kill in range(1, kills + 1):
                row = await one_kill(cluster, nc)
                rows.append([mode, f"{cap / 1000:g} s" if cap else "none (ttl 20)", str(kill), *row])
                print(render_table(HEADERS, rows[-1:]), flush=True)
        finally:
            await nc.close()
            await worker.stop()
    finally:
        await asyncio.to_thread(cluster.stop)
    return rows


async def one_kill(cluster: PatroniCluster, nc: Client) -> list[str]:
    """Kill the leader under load, wait until ``dry`` is served again, bring the node back; the figures."""
    await asyncio.to_thread(cluster.wait_healthy)
    seen = {"buffered": Seen(), "dry": Seen()}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(requester(nc, t, seen[t], stop)) for t in seen for _ in range(2)]
    await wait_for(lambda: len(seen["dry"].ok) >= 200)
    killed_at = time.monotonic()
    old = await asyncio.to_thread(cluster.kill_leader)
    await asyncio.to_thread(cluster.wait_leader, other_than=old, timeout=120)
    leader_at = time.monotonic()
    # Served again: a dry reply after the last error (the tag's 50-ID segments last milliseconds, so any
    # success after the kill came from a fetch on the new primary, bar one in flight at the kill).
    dry = seen["dry"]
    await wait_for(lambda: bool(dry.error_times) and any(done > dry.error_times[-1] for _, done in dry.ok))
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*tasks)
    after_last_error = [done for _, done in dry.ok if done > dry.error_times[-1]]
    # The longest time no `buffered` request was answered (two requesters ask all along).
    done = [answered for _, answered in seen["buffered"].ok]
    stall = max((b - a for a, b in itertools.pairwise(done)), default=0.0)
    duplicates = sum(len(t.ids) - len(set(t.ids)) for t in seen.values())  # tags share no ID space
    ids = len(seen["dry"].ids) + len(seen["buffered"].ids)
    old.reset()
    await asyncio.to_thread(old.start)
    return [
        f"{leader_at - killed_at:.1f}",
        f"{min(after_last_error) - killed_at:.1f}" if after_last_error else "flapping",
        str(seen["dry"].errors["unavailable"]), str(seen["dry"].timeouts),
        str(sum(seen["buffered"].errors.values())), str(seen["buffered"].timeouts),
        f"{stall * 1000:.0f}", str(duplicates), str(ids),
    ]  # fmt: skip


HEADERS = [
    "replication", "ZK session cap", "kill", "leader s", "dry served s", "dry unavailable", "dry timeouts",
    "buffered errors", "buffered timeouts", "buffered stall ms", "duplicates", "IDs",
]  # fmt: skip


async def main() -> None:
    """Parse the options, run every setting, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--settings", default="strict:6000,strict:none,async:6000,async:none")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pg-failover-") as tmp, NatsServer(Path(tmp) / "nats") as server:
        for n, setting in enumerate(args.settings.split(",")):
            mode, _, cap = setting.partition(":")
            rows += await one_setting(
                mode, None if cap == "none" else int(cap), args.kills, Path(tmp) / f"c{n}", server.url
            )
    print()
    print(render_table(HEADERS, rows))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
