"""Idempotent retries: the same ``request_id`` within a TTL gets the same IDs, not new ones."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from dispenser.core.errors import InvalidRequest

__all__ = ["ReplayCache", "reused_request_id"]

T = TypeVar("T")
Key = tuple[str, str]
Params = tuple[int, str]


class ReplayCache(Generic[T]):
    """Remembers each request's result by ``(tag, request_id)`` for ``ttl`` seconds.

    Concurrent requests with the same key share one computation, so a client that retries before its
    first attempt was answered still gets one set of IDs. Bounded to ``max_entries`` (oldest evicted
    first) so a client minting fresh request IDs cannot grow memory without limit.
    """

    def __init__(self, ttl: float, clock: Callable[[], float], max_entries: int = 100_000) -> None:
        self.ttl = ttl
        self._clock = clock
        self._max = max_entries
        self._done: OrderedDict[Key, tuple[float, Params, T]] = OrderedDict()
        self._pending: dict[Key, tuple[Params, asyncio.Future[T]]] = {}

    def __len__(self) -> int:
        return len(self._done)

    async def get_or_compute(self, key: Key, params: Params, compute: Callable[[], Awaitable[T]]) -> T:
        """The remembered result for ``key``, or ``compute()``'s, remembered from now on.

        Raises:
            InvalidRequest: the ``request_id`` was used with a different count or format.
        """
        now = self._clock()
        self._expire(now)
        entry = self._done.get(key)
        if entry is not None:
            _, seen_params, result = entry
            self._check(key, params, seen_params)
            return result
        pending = self._pending.get(key)
        if pending is not None:
            self._check(key, params, pending[0])
            return await asyncio.shield(pending[1])
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending[key] = (params, future)
        try:
            result = await compute()
        except BaseException as exc:
            # A failed attempt issued no IDs: let the retry compute afresh.
            future.set_exception(exc)
            future.exception()  # mark retrieved: nobody else may be waiting
            raise
        finally:
            del self._pending[key]
        future.set_result(result)
        self._done[key] = (now, params, result)
        while len(self._done) > self._max:
            self._done.popitem(last=False)
        return result

    def _expire(self, now: float) -> None:
        done = self._done
        while done:
            key, (at, _, _) = next(iter(done.items()))
            if now - at < self.ttl:
                break
            del done[key]

    @staticmethod
    def _check(key: Key, params: Params, seen: Params) -> None:
        if params != seen:
            raise reused_request_id(key[1], *seen)


def reused_request_id(request_id: str, count: int, format: str) -> InvalidRequest:
    """The error for a ``request_id`` sent again with another count or format than its first use."""
    return InvalidRequest(
        f"request_id {request_id!r} was already used with count {count} and format {format!r}; "
        "use a new request_id for a different request"
    )
