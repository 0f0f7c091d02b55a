"""The buffered client for code without an event loop (a WSGI app, a thread pool): same API, blocking.

An :class:`~dispenser.client.buffered.IdClient` runs on an event loop in a thread of its own; each tag has
a cursor here behind a lock of its own, refilled from the loop thread one run of IDs at a time. How runs
are sized, and the ordering promise: ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from operator import length_hint
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

from dispenser.client.buffered import BufferSettings, ClientStats, IdClient, IdTransport, next_run
from dispenser.config import KafkaConfig, NatsConfig
from dispenser.core.ids import Range
from dispenser.messages import Format, Kind

__all__ = ["BlockingIdClient"]

T = TypeVar("T")

_FAST = 0.002
_SLOW = 0.05


class _Cursor:
    """One tag's IDs in hand: an iterator over a range (a plain tag's) or a list (a permuted tag's)."""

    __slots__ = ("end", "iterator", "listed", "lock", "next", "run", "run_at")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.iterator: Iterator[int] = iter(())
        self.next: Callable[[], int] = self.iterator.__next__
        self.end = 0
        """A plain tag's: the last ID of :attr:`iterator`'s range."""
        self.listed = False
        self.run = 1
        self.run_at = time.monotonic()

    def hold(self, ids: range | list[int]) -> None:
        """Hand out ``ids`` next."""
        self.iterator = iter(ids)
        self.next = self.iterator.__next__
        self.listed = isinstance(ids, list)
        if isinstance(ids, range):
            self.end = ids.stop - 1


class BlockingIdClient:
    """:class:`~dispenser.client.buffered.IdClient` for threads: every method blocks; all are thread-safe.

    Args:
        transport: how to reach the dispensers (see :meth:`over_nats`, :meth:`over_kafka`).
        settings: buffer sizes and timeouts.

    Example::

        with BlockingIdClient.over_nats("nats://127.0.0.1:4222") as client:
            order_id = client.next_id("order")
    """

    def __init__(self, transport: IdTransport, settings: BufferSettings | None = None) -> None:
        self._adopt(IdClient(transport, settings))

    def _adopt(self, client: IdClient) -> None:
        self.client = client
        """The asynchronous client underneath (runs on the loop thread: call it through the loop)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="leaf-id-client", daemon=True)
        self._cursors: dict[str, _Cursor] = {}
        self._cursors_lock = threading.Lock()
        settings = self.client.settings
        # A call never waits longer than the client's own deadlines; this is only a backstop.
        self._backstop = settings.timeout + settings.request_timeout + 5.0

    @classmethod
    def over_nats(
        cls, config: NatsConfig | str | None = None, settings: BufferSettings | None = None
    ) -> Self:
        """A client over NATS (connects on :meth:`start`); arguments as :meth:`IdClient.over_nats`."""
        return cls._around(IdClient.over_nats(config, settings))

    @classmethod
    def over_kafka(
        cls,
        config: KafkaConfig | None = None,
        settings: BufferSettings | None = None,
        *,
        reply_topic: str | None = None,
    ) -> Self:
        """A client over Kafka (connects on :meth:`start`); arguments as :meth:`IdClient.over_kafka`."""
        return cls._around(IdClient.over_kafka(config, settings, reply_topic=reply_topic))

    @classmethod
    def _around(cls, client: IdClient) -> Self:
        blocking = cls.__new__(cls)
        blocking._adopt(client)
        return blocking

    def start(self) -> None:
        """Start the loop thread and connect.

        Raises:
            OSError: the broker cannot be reached (the thread is stopped again).
        """
        self._thread.start()
        try:
            self._call(self.client.start())
        except BaseException:
            self._stop_loop()
            raise

    def close(self) -> None:
        """Disconnect and stop the loop thread. IDs still held are skipped, never handed out by anyone."""
        if not self._thread.is_alive():
            if not self._loop.is_closed():  # never started
                self._loop.close()
            return
        try:
            self._call(self.client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(self._backstop)

    def _cursor(self, tag: str) -> _Cursor:
        cursor = self._cursors.get(tag)
        if cursor is None:
            with self._cursors_lock:
                cursor = self._cursors.setdefault(tag, _Cursor())
        return cursor

    def _refill(self, tag: str, cursor: _Cursor) -> None:
        """Fill the empty cursor with the next run (the caller holds its lock)."""
        # Thresholds above the async client's: each run costs a crossing to the loop thread.
        cursor.run = next_run(cursor.run, time.monotonic() - cursor.run_at, _FAST, _SLOW)
        cursor.hold(self._call(self.client.take_block(tag, cursor.run)))
        cursor.run_at = time.monotonic()

    def next_id(self, tag: str, kind: Kind = "segment") -> int:
        """As :meth:`IdClient.next_id <dispenser.client.buffered.IdClient.next_id>`, blocking."""
        if kind != "segment":
            return self._call(self.client.next_id(tag, kind))
        cursor = self._cursor(tag)
        with cursor.lock:
            try:
                return cursor.next()
            except StopIteration:
                self._refill(tag, cursor)
                return cursor.next()

    @overload
    def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Literal["ids"] = "ids"
    ) -> list[int]: ...

    @overload
    def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Literal["ranges"]
    ) -> list[Range]: ...

    def take(
        self, tag: str, count: int, *, kind: Kind = "segment", format: Format = "ids"
    ) -> list[int] | list[Range]:
        """As :meth:`IdClient.take <dispenser.client.buffered.IdClient.take>`, blocking."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if kind != "segment":
            ranges = self._call(self.client.take(tag, count, kind=kind, format="ranges"))
        else:
            cursor = self._cursor(tag)
            with cursor.lock:
                held = length_hint(cursor.iterator)
                if not cursor.listed and held >= count:
                    first = cursor.end + 1 - held
                    cursor.hold(range(first + count, cursor.end + 1))
                    ranges = [(first, first + count - 1)]
                else:
                    # The cursor's rest, then the client's next IDs (a plain tag's all above it): one lock,
                    # so no other thread's IDs come between.
                    if cursor.listed:  # a permuted tag's: one range per ID
                        ranges = [(i, i) for i in itertools.islice(cursor.iterator, count)]
                    else:
                        ranges = [(cursor.end + 1 - held, cursor.end)] if held else []
                        cursor.hold(range(0))
                    rest = count - min(held, count)
                    more = self._call(self.client.take(tag, rest, format="ranges")) if rest else []
                    for a, b in more:
                        if ranges and ranges[-1][1] + 1 == a:
                            ranges[-1] = (ranges[-1][0], b)
                        else:
                            ranges.append((a, b))
        if format == "ids":
            return [i for a, b in ranges for i in range(a, b + 1)]
        return ranges

    def stats(self, tag: str) -> ClientStats | None:
        """As :meth:`IdClient.stats <dispenser.client.buffered.IdClient.stats>`; this client's cursors count as handed out."""
        return self.client.stats(tag)
