"""Running a coroutine from synchronous code (the CLI, the benchmarks, the dev stack) on the fast loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_async"]

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T], *, fast: bool = True) -> T:
    """Run ``coro`` to completion on uvloop (asyncio's own loop where uvloop is missing, or with ``fast=False``).

    ``fast=False`` is for processes that talk TLS to Kafka: on uvloop, closing a TLS connection while the
    broker still has a response under way (a consumer's long-poll fetch, nearly always) waits out uvloop's
    30 s TLS shutdown timeout (uvloop issue 471: it reads no data during the shutdown), so a stop or a
    ``dispenser get`` took 30 s about every other time. asyncio's loop closes the same connection in the
    fetch's 0.5 s.
    """
    if not fast:
        return asyncio.run(coro)
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up, imported only when running
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we run on
        return asyncio.run(coro)
    return uvloop.run(coro)
