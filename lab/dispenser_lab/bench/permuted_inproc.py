"""A permuted tag's cost in process: ``Dispatcher.answer_now`` for a plain tag and a permuted one, side by side.

``python -m dispenser_lab.bench.permuted_inproc``: the memory store, one thread, the plain and the permuted tag
measured alternately, best of ``--repeat`` rounds per request size; then FF3-1 per ID over radix 10 (what a
permuted tag uses) and radix 2 (59 binary digits, the alternative weighed in docs/permuted.md). Figures in
docs/benchmarks.md ("Permuted tags").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import time
from collections.abc import Callable

from ff3 import FF3Cipher  # type: ignore[import-untyped]

from dispenser.core.permute import Permutation, tweak_of
from dispenser.messages import IdRequest
from dispenser.ports import SystemClock
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing import MemorySegmentStore

__all__ = ["main"]

_KEY = bytes(range(16))  # a bench key: nothing it permutes is kept


def _best_per_call(call: Callable[[], object], calls: int, repeat: int) -> float:
    """Seconds per call, the best of ``repeat`` rounds of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


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


async def _run(calls: int, repeat: int) -> None:
    dispatcher = await _dispatcher()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| IDs a request | plain µs per request | permuted µs per request | permuted µs per ID |")
    print("|---|---|---|---|")
    for count in (1, 10, 100):
        request = IdRequest(count=count)
        n = max(1, calls // count)
        plain = permuted = float("inf")
        for _ in range(repeat):  # alternately, so both see the same load
            plain = min(
                plain, _best_per_call(functools.partial(dispatcher.answer_now, "plain", request), n * 10, 1)
            )
            permuted = min(
                permuted, _best_per_call(functools.partial(dispatcher.answer_now, "permuted", request), n, 1)
            )
        print(f"| {count} | {plain * 1e6:.2f} | {permuted * 1e6:.1f} | {permuted / count * 1e6:.1f} |")
    tweak = tweak_of("bench")
    radix10 = FF3Cipher(_KEY.hex(), tweak, 10)
    radix2 = FF3Cipher.withCustomAlphabet(_KEY.hex(), tweak, "01")
    per10 = _best_per_call(lambda: radix10.encrypt(f"{12345:018d}"), calls, repeat)
    per2 = _best_per_call(lambda: radix2.encrypt(f"{12345:059b}"), calls // 3, repeat)
    print(f"FF3-1 per ID: radix 10, 18 digits {per10 * 1e6:.1f} µs; radix 2, 59 digits {per2 * 1e6:.1f} µs")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    """Print the table (markdown) and the cipher's cost per ID."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.permuted_inproc")
    parser.add_argument("--calls", type=int, default=2000, help="calls of one ID per round (default 2000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept (default 5)")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.calls, args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
