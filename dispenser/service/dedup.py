"""Idempotent retries: the same ``request_id`` within a TTL gets the same IDs, not new ones."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

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
        # key -> [params, when it started, the future its copies wait on (made for the first copy)]
        self._pending: dict[Key, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._done)

    async def get_or_compute(self, key: Key, params: Params, compute: Callable[[], Awaitable[T]]) -> T:
        """The remembered result for ``key``, or ``compute()``'s, remembered from now on.

        Raises:
            InvalidRequest: the ``request_id`` was used with a different count or format.
        """
        held = self.held(key, params)
        if held is not None:
            return await held if isinstance(held, asyncio.Future) else held
        try:
            result = await compute()
        except BaseException as exc:
            self.fail(key, exc)
            raise
        self.remember(key, result)
        return result

    def held(self, key: Key, params: Params) -> T | asyncio.Future[T] | None:
        """What ``key`` is bound to: its result, a future of the result being computed, or ``None``.

        ``None`` makes the caller the one computing: it must end with :meth:`remember` or :meth:`fail`
        (the synchronous steps of :meth:`get_or_compute`, for a caller that waits on one future only).

        Raises:
            InvalidRequest: the ``request_id`` was used with a different count or format.
        """
        now = self._clock()
        self._expire(now)
        entry = self._done.get(key)
        if entry is not None:
            self._check(key, params, entry[1])
            return entry[2]
        pending = self._pending.get(key)
        if pending is not None:
            self._check(key, params, pending[0])
            future = pending[2]
            if future is None:  # the first copy: made only now, most keys never see one
                future = pending[2] = asyncio.get_running_loop().create_future()
            return asyncio.shield(future)
        self._pending[key] = [params, now, None]
        return None

    def remember(self, key: Key, result: T) -> None:
        """End the computation :meth:`held` handed out: ``result`` is ``key``'s from now on."""
        params, started, future = self._pending.pop(key)
        if future is not None:
            future.set_result(result)
        self._done[key] = (started, params, result)
        while len(self._done) > self._max:
            self._done.popitem(last=False)

    def fail(self, key: Key, exc: BaseException) -> None:
        """End the computation :meth:`held` handed out without a result (a failed attempt issued no IDs)."""
        _, _, future = self._pending.pop(key)
        if future is not None:
            future.set_exception(exc)
            future.exception()  # mark retrieved: the copies may have gone

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
