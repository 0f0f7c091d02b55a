"""A bounded table whose newcomers evict each other before they evict an entry in use (a segmented LRU).

Pure: the caller passes the time (seconds) into every call. Used for the snowflake rate meters, whose tag
names any caller may invent (``docs/operations.md``, "Meters of snowflake tags").
"""

from __future__ import annotations

import collections
import math
from typing import Generic, TypeVar

__all__ = ["ProtectedLru"]

K = TypeVar("K")
V = TypeVar("V")


class _Entry(Generic[V]):
    __slots__ = ("last", "value")

    def __init__(self, value: V, second: int) -> None:
        self.value = value
        self.last = second  # the last whole second it was used in


class ProtectedLru(Generic[K, V]):
    """At most ``capacity`` entries; a full table evicts the least recently used newcomer first.

    An entry is a *newcomer* (on probation) until it is used again in a later second than the one it was
    added in; then it is *established*. Adding to a full table evicts the least recently used newcomer, or,
    when there is none, the least recently used established entry. So a flood of keys each used within one
    second (invented tag names) evicts at most one established entry, however long it lasts: after the first
    eviction there is always a newcomer to evict instead. Recency is kept per second (an entry moves at most
    once a second), so a hit costs a dict lookup and, once a second, a move.

    Args:
        capacity: the most entries held (at least 1).
    """

    __slots__ = ("_established", "_newcomers", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        # Both in order of last use, least recent first. A newcomer is used only in the second it was
        # added in (else it is established), so insertion order is its recency order.
        self._newcomers: collections.OrderedDict[K, _Entry[V]] = collections.OrderedDict()
        self._established: collections.OrderedDict[K, _Entry[V]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._newcomers) + len(self._established)

    def __contains__(self, key: object) -> bool:
        return key in self._established or key in self._newcomers

    def get(self, key: K, now: float) -> V | None:
        """The value of ``key``, used at ``now`` (``None`` if absent)."""
        entry = self._established.get(key)
        if entry is not None:
            second = math.floor(now)
            if second > entry.last:
                entry.last = second
                self._established.move_to_end(key)
            return entry.value
        entry = self._newcomers.get(key)
        if entry is None:
            return None
        second = math.floor(now)
        if second > entry.last:  # used again in a later second: established
            del self._newcomers[key]
            entry.last = second
            self._established[key] = entry
        return entry.value

    def peek(self, key: K) -> V | None:
        """The value of ``key`` without using it (``None`` if absent)."""
        entry = self._established.get(key) or self._newcomers.get(key)
        return None if entry is None else entry.value

    def add(self, key: K, value: V, now: float) -> tuple[K, V] | None:
        """Add ``key`` (absent) as a newcomer used at ``now``; returns the entry evicted to make room, if any."""
        if key in self:
            raise KeyError(f"{key!r} is already in the table")
        evicted = None
        if len(self) >= self.capacity:
            victims = self._newcomers or self._established
            old_key, old = victims.popitem(last=False)
            evicted = (old_key, old.value)
        self._newcomers[key] = _Entry(value, math.floor(now))
        return evicted

    def expire(self, now: float, *, newcomer_idle: float, established_idle: float) -> list[tuple[K, V]]:
        """Remove the newcomers unused for over ``newcomer_idle`` seconds and the others for ``established_idle``.

        Returns:
            The entries removed, least recently used first.
        """
        removed: list[tuple[K, V]] = []
        for table, idle in ((self._newcomers, newcomer_idle), (self._established, established_idle)):
            while table:
                key, entry = next(iter(table.items()))
                if entry.last + 1 + idle > now:  # in use until the end of its last second
                    break
                del table[key]
                removed.append((key, entry.value))
        return removed

    def items(self) -> list[tuple[K, V]]:
        """Every entry, established ones first, each tier least recently used first."""
        return [(k, e.value) for k, e in self._established.items()] + [
            (k, e.value) for k, e in self._newcomers.items()
        ]

    def established(self, key: K) -> bool:
        """Whether ``key`` has been used in more than one second (it is evicted only after every newcomer)."""
        return key in self._established
