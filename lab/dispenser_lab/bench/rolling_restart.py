"""IDs lost per rolling restart of 3 workers, with ``segment.return_unused`` off and on (issue 31 item 4).

Run by hand: ``python -m dispenser_lab.bench.rolling_restart [--step 1000] [--rounds 3]``. It starts NATS
and PostgreSQL from the kit, three ``dispenser serve`` processes (adaptive step off: segments of ``--step``)
under a steady load of 7-ID requests, and restarts them one after another with SIGTERM, each replaced
before the next goes. Then it counts: every ID the store granted (``max_id - 1``) is answered, still
buffered by a live worker (``leaf_ids_buffered``), waiting in ``dispenser_returned_range``, or lost. It
checks that no ID was answered twice. Figures: docs/segment.md ("Unused IDs returned on a clean stop").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import msgspec
import nats
from nats.aio.client import Client

from dispenser.messages import Reply
from dispenser_lab.bench.servers import bench_servers, prepare_tags
from dispenser_lab.servers import free_port

__all__ = ["Outcome", "main", "rolling_restart"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One run's accounting, in IDs."""

    return_unused: bool
    granted: int
    answered: int
    buffered: int
    returned: int
    repeated: int

    @property
    def lost(self) -> int:
        """Granted, and neither answered, nor buffered by a live worker, nor waiting to be handed out again."""
        return self.granted - self.answered - self.buffered - self.returned


class _Worker:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.metrics_port = free_port()
        self.env = env | {"DISPENSER_METRICS_PORT": str(self.metrics_port)}
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "dispenser", "serve", env=os.environ | self.env, stdout=out, stderr=out
            )

    async def stop(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 15)

    def buffered(self, tag: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as page:
            text = page.read().decode()
        found = re.search(rf'^leaf_ids_buffered\{{tag="{re.escape(tag)}"\}} (\S+)$', text, re.MULTILINE)
        return 0 if found is None else int(float(found.group(1)))


async def _serving(nc: Client, workers: int, timeout: float = 30.0) -> None:
    """Until ``workers`` workers answer ``$SRV.PING`` (each has started its NATS service)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.PING.leaf-dispenser", b"", reply=inbox)
        seen = set()
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
            while True:
                seen.add((await sub.next_msg(timeout=0.3)).data)
        await sub.unsubscribe()
        if len(seen) >= workers:
            return
    raise RuntimeError(f"fewer than {workers} workers serving after {timeout} s")


@contextlib.asynccontextmanager
async def _load(nc: Client, subject: str, answered: list[int], callers: int = 4) -> AsyncIterator[None]:
    """``callers`` loops of 7-ID requests while the block runs; every ID answered goes into ``answered``."""
    stop = asyncio.Event()
    decoder = msgspec.json.Decoder(Reply)

    async def caller() -> None:
        while not stop.is_set():
            try:
                msg = await nc.request(subject, b'{"count": 7}', timeout=1.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.01)
                continue
            reply = decoder.decode(msg.data)
            if reply.error is None and reply.ranges is not None:
                answered.extend(i for first, last in reply.ranges for i in range(first, last + 1))
            elif reply.error is None and reply.ids is not None:
                answered.extend(reply.ids)

    tasks = [asyncio.create_task(caller()) for _ in range(callers)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def rolling_restart(
    nats_url: str, dsn: str, workdir: Path, *, return_unused: bool, step: int, rounds: int
) -> Outcome:
    """Three workers under load, restarted ``rounds`` times one after another; the run's accounting."""
    tag = f"roll_{'on' if return_unused else 'off'}"
    await prepare_tags(dsn, [(tag, step, 1)])
    prefix = f"roll{int(return_unused)}"
    subject = f"{prefix}.segment.{tag}"

    def env(name: str) -> dict[str, str]:
        return {
            "DISPENSER_NATS_URL": nats_url,
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
            "DISPENSER_SEGMENT_STATE_DIR": str(workdir / tag / name),
            "DISPENSER_SEGMENT_RETURN_UNUSED": str(return_unused).lower(),
            "DISPENSER_RATE_ADAPTIVE_STEP": "false",
            "DISPENSER_SNOWFLAKE_ENABLED": "false",
        }

    workers = [_Worker(env(f"w{i}"), workdir / f"{tag}-w{i}.log") for i in range(3)]
    answered: list[int] = []
    nc = await nats.connect(nats_url)
    try:
        for worker in workers:
            await worker.start()
        await _serving(nc, 3)
        async with _load(nc, subject, answered):
            await asyncio.sleep(1.0)  # paces the run: load before the first restart
            for round_ in range(rounds):
                for i in range(3):
                    await workers[i].stop()
                    workers[i] = _Worker(env(f"w{i}"), workdir / f"{tag}-w{i}-{round_}.log")
                    await workers[i].start()
                    await _serving(nc, 3)
            await asyncio.sleep(1.0)  # load after the last restart
        buffered = sum(w.buffered(tag) for w in workers)
        conn = await asyncpg.connect(dsn)
        try:
            max_id = await conn.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = $1", tag)
            returned = await conn.fetchval(
                "SELECT COALESCE(sum(last_id - first_id + 1), 0) FROM dispenser_returned_range "
                "WHERE biz_tag = $1",
                tag,
            )
        finally:
            await conn.close()
    finally:
        await nc.close()
        for worker in workers:
            if worker.proc is not None:
                await worker.stop()
    return Outcome(
        return_unused,
        max_id - 1,
        len(set(answered)),
        buffered,
        int(returned),
        len(answered) - len(set(answered)),
    )


async def _main(step: int, rounds: int, keep: Path | None) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="rolling-restart-") as tmp:
        workdir = Path(tmp) if keep is None else keep
        with bench_servers(workdir, None, None) as (nats_url, _pid, dsn):
            assert dsn is not None
            return [
                await rolling_restart(nats_url, dsn, workdir, return_unused=on, step=step, rounds=rounds)
                for on in (False, True)
            ]


def main(argv: list[str] | None = None) -> int:
    """Run both settings and print one line each; exit 1 if an ID was answered twice."""
    parser = argparse.ArgumentParser(
        prog="python -m dispenser_lab.bench.rolling_restart", description=__doc__
    )
    parser.add_argument("--step", type=int, default=1000, help="the tag's segment size (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="rolling restarts of the 3 workers (default 3)")
    parser.add_argument(
        "--keep", type=Path, help="a directory to keep the workers' logs in (default: none kept)"
    )
    args = parser.parse_args(argv)
    outcomes = asyncio.run(_main(args.step, args.rounds, args.keep))
    print("return_unused  granted  answered  buffered  returned  lost  lost/restart  repeated")
    for o in outcomes:
        print(
            f"{str(o.return_unused).lower():>13}  {o.granted:>7}  {o.answered:>8}  {o.buffered:>8}  "
            f"{o.returned:>8}  {o.lost:>4}  {o.lost / args.rounds:>12.0f}  {o.repeated:>8}"
        )
    return 1 if any(o.repeated for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
