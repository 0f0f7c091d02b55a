"""``dispenser watch``: every tag's consumption across the fleet, built only from the rate events on NATS.

It needs nothing but NATS access (subject ``<prefix>.rate.>``): run it from any machine (with NATS
gateways, from any datacenter: the events cross them). Workers that name their datacenter
(``nats.datacenter``) are shown per datacenter, with the whole fleet's row under them. The live view
redraws in place every second (q or Ctrl-C quits); ``--once`` listens for one event interval and prints one
table; ``--json`` prints each event as a JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

import msgspec

from dispenser.config import Config
from dispenser.messages import RateEvent
from dispenser.tables import render_table

__all__ = ["Fleet", "run_watch"]


@dataclass
class _WorkerSeen:
    first: RateEvent
    last: RateEvent
    received: float


@dataclass
class Fleet:
    """The latest event of every worker, per (kind, tag); workers silent for ``stale_after`` drop out."""

    stale_after: float = 15.0
    workers: dict[tuple[str, str], dict[str, _WorkerSeen]] = field(default_factory=dict)

    def add(self, event: RateEvent, received: float) -> None:
        """Take one event."""
        seen = self.workers.setdefault((event.kind, event.tag), {})
        previous = seen.get(event.worker)
        seen[event.worker] = _WorkerSeen(previous.first if previous else event, event, received)

    def rows(self, now: float) -> Iterator[list[str]]:
        """One table row per (tag, kind), sorted; with datacenters, one per datacenter and the fleet's.

        When any live worker names its datacenter (``nats.datacenter``), each (tag, kind) has a row per
        datacenter (``-``: workers that name none) and a row ``all`` with the whole fleet, and the table
        gains a ``DC`` column after ``KIND`` (see :meth:`headers`).
        """
        by_datacenter = self.datacenters(now)
        for (kind, tag), seen in sorted(self.workers.items(), key=lambda item: (item[0][1], item[0][0])):
            live = [w for w in seen.values() if now - w.received <= self.stale_after]
            if not live:
                continue
            if not by_datacenter:
                yield [tag, kind, *_summary(kind, live)]
                continue
            for datacenter in sorted({w.last.datacenter for w in live}):
                here = [w for w in live if w.last.datacenter == datacenter]
                yield [tag, kind, datacenter or "-", *_summary(kind, here)]
            yield [tag, kind, "all", *_summary(kind, live)]

    def datacenters(self, now: float) -> bool:
        """Whether any live worker names its datacenter (the table then shows them)."""
        return any(
            w.last.datacenter
            for seen in self.workers.values()
            for w in seen.values()
            if now - w.received <= self.stale_after
        )

    def headers(self, now: float) -> list[str]:
        """The table's columns (``DC`` only when a live worker names its datacenter)."""
        dc = ["DC"] if self.datacenters(now) else []
        return ["TAG", "KIND", *dc, "WORKERS", "IDS/S", "PEAK/S", "STEP", "BUFFERED", "RUNWAY", "FETCH/MIN"]

    def table(self, now: float) -> str:
        """The table as text."""
        headers = self.headers(now)
        rows = list(self.rows(now))
        if not rows:
            return render_table(headers, []) + "\n(no rate events yet)"
        return render_table(headers, rows)


def _summary(kind: str, live: list[_WorkerSeen]) -> list[str]:
    """The columns after TAG and KIND (and DC) for a set of live workers: their sums, steps, least runway."""
    last = [w.last for w in live]
    runways = [e.runway_s for e in last if e.runway_s is not None]
    steps = sorted({e.step for e in last if e.step})
    fetches_per_min = sum(_fetches_per_min(w) for w in live)
    return [
        str(len(live)),
        f"{sum(e.ids_per_s for e in last):,.0f}",
        f"{sum(e.peak_ids_per_s for e in last):,.0f}",
        ",".join(f"{s:,}" for s in steps) or "-",
        f"{sum(e.ids_buffered for e in last):,}" if kind == "segment" else "-",
        f"{min(runways):,.0f}s" if runways else ("inf" if kind == "segment" else "-"),
        f"{fetches_per_min:.1f}" if kind == "segment" else "-",
    ]


def _fetches_per_min(seen: _WorkerSeen) -> float:
    """The worker's own figure; for a worker that predates it, the change in ``fetches`` over what we saw."""
    if seen.last.fetches_per_min is not None:
        return seen.last.fetches_per_min
    span = seen.last.time - seen.first.time
    return (seen.last.fetches - seen.first.fetches) / span * 60 if span > 0 else 0.0


async def run_watch(
    config: Config,
    *,
    once: bool = False,
    as_json: bool = False,
    out: TextIO = sys.stdout,
    timeout: float = 5.0,
) -> int:
    """Watch until q, Ctrl-C or SIGTERM (``once``: one event interval, one table).

    Raises:
        OSError: NATS cannot be reached within ``timeout`` seconds.
    """
    from dispenser.adapters.nats.rates import listening_to_rates  # noqa: PLC0415 - importable without NATS

    fleet = Fleet(stale_after=max(config.rate.stale_after, 3 * config.rate.interval))

    def received(event: RateEvent) -> None:
        fleet.add(event, time.monotonic())
        if as_json:
            out.write(msgspec.json.encode(event).decode() + "\n")
            out.flush()

    async with listening_to_rates(config.nats, received, deadline=timeout):
        if once:
            await asyncio.sleep(config.rate.interval + 0.5)
            if not as_json:
                out.write(fleet.table(time.monotonic()) + "\n")
            return 0
        await _live(fleet, out, show=not as_json)
        return 0


async def _live(fleet: Fleet, out: TextIO, *, show: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with _keys(lambda key: stop.set() if key in "qQ" else None):
        try:
            while not stop.is_set():
                if show:
                    stamp = time.strftime("%H:%M:%S")
                    out.write(f"\x1b[H\x1b[J{fleet.table(time.monotonic())}\n\n{stamp}  q quits\n")
                    out.flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


@contextlib.contextmanager
def _keys(on_key: Callable[[str], None]) -> Iterator[None]:
    """Hand single key presses to ``on_key`` while the terminal is in cbreak mode (no-op without a tty)."""
    stdin = sys.stdin
    if not stdin.isatty():
        yield
        return
    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()
    tty.setcbreak(fd)
    loop.add_reader(fd, lambda: on_key(stdin.read(1)))
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
