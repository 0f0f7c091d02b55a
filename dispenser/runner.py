"""Running a coroutine from synchronous code (the CLI, the benchmarks, the dev stack) on the fast loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_async"]

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on uvloop (asyncio's own loop where uvloop is missing)."""
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up, imported only when running
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we run on
        return asyncio.run(coro)
    return uvloop.run(coro)
