"""A permuted tag's cost in process: the cipher per ID before and now, and ``answer_now`` plain against permuted.

``python -m dispenser_lab.bench.permuted_inproc [--json PATH]``: one thread, best of ``--repeat`` rounds.
First the cipher per ID: the ``ff3`` package one by one (what permuted tags used before, and the tests'
oracle), radix 10 and radix 2 (59 binary digits, the alternative weighed in docs/permuted.md), then
``Permutation.encode`` and ``decode`` one by one and ``Permutation.ids`` of 10 to 10,000 counters at once.
Then ``Dispatcher.answer_now`` over the memory store for a plain and a permuted tag, alternately, per
request size up to ``MAX_PERMUTED_IDS``. Figures in docs/benchmarks.md ("Permuted tags").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ff3 import FF3Cipher  # type: ignore[import-untyped]  # the cipher permuted tags used before

from dispenser.core.permute import Permutation, tweak_of
from dispenser.messages import IdRequest
from dispenser.ports import SystemClock
from dispenser.service.dispatch import MAX_PERMUTED_IDS, Dispatcher, Limits
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing import MemorySegmentStore
from dispenser_lab.bench.stats import host_meta

__all__ = ["main"]

_KEY = bytes(range(16))  # a bench key: nothing it permutes is kept
_START = 123_456_789_012  # counters from here: a tag well under way


@dataclass(frozen=True, slots=True)
class CipherRow:
    """The cipher's cost per ID in one way of calling it."""

    case: str
    us_per_id: float
    ids_per_s: int
    times_faster_than_ff3: float


@dataclass(frozen=True, slots=True)
class RequestRow:
    """``answer_now`` for one request size, plain and permuted."""

    ids_a_request: int
    plain_us_per_request: float
    permuted_us_per_request: float
    permuted_us_per_id: float


def _best_per_call(call: Callable[[], object], calls: int, repeat: int) -> float:
    """Seconds per call, the best of ``repeat`` rounds of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def _per_id(run: Callable[[], object], ids: int, repeat: int) -> float:
    """Seconds per ID of ``run``, which handles ``ids`` IDs: the best of ``repeat`` runs."""
    return _best_per_call(run, 1, repeat) / ids


def _cipher_rows(calls: int, repeat: int) -> list[CipherRow]:
    """The cipher's cost per ID, the package's one by one first: each row's µs and its speed-up over ff3."""
    tweak = tweak_of("bench")
    radix10 = FF3Cipher(_KEY.hex(), tweak, 10)
    radix2 = FF3Cipher.withCustomAlphabet(_KEY.hex(), tweak, "01")
    permutation = Permutation("bench", {1: _KEY})
    counters = range(_START, _START + calls)
    ids = permutation.ids([(_START, _START + calls - 1)])
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("ff3 package, radix 10, one by one (before)", lambda: [radix10.encrypt(f"{n:018d}") for n in counters], calls),
        ("ff3 package, radix 2 (59 digits), one by one", lambda: [radix2.encrypt(f"{n:059b}") for n in counters[: calls // 3 or 1]], calls // 3 or 1),
        ("encode, one by one", lambda: [permutation.encode(n) for n in counters], calls),
        ("decode, one by one", lambda: [permutation.decode(i) for i in ids], calls),
    ]  # fmt: skip
    for size in (10, 100, 1_000, 10_000):
        cases.append(
            (
                f"ids, {size:,} at once",
                functools.partial(permutation.ids, [(_START, _START + size - 1)]),
                size,
            )
        )
    seconds = [_per_id(run, count, repeat) for _, run, count in cases]
    return [
        CipherRow(name, round(s * 1e6, 3), round(1 / s), round(seconds[0] / s, 1))
        for (name, _, _), s in zip(cases, seconds, strict=True)
    ]


async def _dispatcher() -> Dispatcher:
    store = MemorySegmentStore()
    for tag in ("plain", "permuted"):
        await store.add_tag(tag, 10_000_000)
    clock = SystemClock()
    allocator = SegmentAllocator(store, clock, AllocatorSettings())
    await allocator.refresh()
    dispatcher = Dispatcher(
        allocator, clock, Limits(), permuted={"permuted": Permutation("permuted", {1: _KEY})}
    )
    for tag in ("plain", "permuted"):  # the first segments fetched, outside the timing
        await dispatcher.answer(tag, IdRequest(count=1))
    return dispatcher


async def _request_rows(calls: int, repeat: int) -> list[RequestRow]:
    """``answer_now`` per request, plain and permuted alternately (both see the same load), ``ids`` format."""
    dispatcher = await _dispatcher()
    rows: list[RequestRow] = []
    for count in sorted({1, 10, 100, 1_000, MAX_PERMUTED_IDS}):
        request = IdRequest(count=count)
        n = max(1, calls // count)
        plain = permuted = float("inf")
        for _ in range(repeat):
            plain = min(
                plain, _best_per_call(functools.partial(dispatcher.answer_now, "plain", request), n * 10, 1)
            )
            permuted = min(
                permuted, _best_per_call(functools.partial(dispatcher.answer_now, "permuted", request), n, 1)
            )
        rows.append(
            RequestRow(
                count, round(plain * 1e6, 2), round(permuted * 1e6, 1), round(permuted / count * 1e6, 3)
            )
        )
    return rows


def _print_tables(cipher: list[CipherRow], requests: list[RequestRow]) -> None:
    print("| the cipher | µs per ID | IDs a second | speed-up over the ff3 package |")
    print("|---|---|---|---|")
    for c in cipher:
        print(f"| {c.case} | {c.us_per_id} | {c.ids_per_s:,} | {c.times_faster_than_ff3} |")
    print()
    print("| IDs a request | plain µs per request | permuted µs per request | permuted µs per ID |")
    print("|---|---|---|---|")
    for r in requests:
        print(
            f"| {r.ids_a_request:,} | {r.plain_us_per_request} | {r.permuted_us_per_request} "
            f"| {r.permuted_us_per_id} |"
        )


def main(argv: list[str] | None = None) -> int:
    """Print both tables (markdown) between the load averages; ``--json PATH`` writes them too."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.permuted_inproc")
    parser.add_argument("--calls", type=int, default=2000, help="IDs one by one per round (default 2000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept (default 5)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    started, load_before = datetime.datetime.now(datetime.UTC), os.getloadavg()
    print("load average before: " + " ".join(f"{x:.2f}" for x in load_before))
    cipher = _cipher_rows(args.calls, args.repeat)
    requests = asyncio.run(_request_rows(args.calls, args.repeat))
    _print_tables(cipher, requests)
    meta = host_meta(started, load_before)
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.json:
        doc = {**meta, "cipher": [asdict(c) for c in cipher], "requests": [asdict(r) for r in requests]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
