"""On a clean stop, the unused rest of each tag's segments goes back to the store (``segment.return_unused``).

Fenced in the worker: each tag's buffer is closed (every take refused from then on; a segment in flight
lands, never served) before its rest is read, so no answer sent later can carry an ID of a returned range. The worker
calls this after every transport has drained. Why and what is guaranteed: ``docs/segment.md`` ("Unused IDs
returned on a clean stop").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dispenser.core.errors import StoreUnavailable
from dispenser.core.residue import StridedRange
from dispenser.ports import Clock, SegmentStore
from dispenser.service.segments import SegmentAllocator, TagAllocator
from dispenser.service.timing import run_within

__all__ = ["Returned", "return_unused", "surrender"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Returned:
    """What a stop gave back."""

    offered: int
    """Unused IDs the buffers held when they were closed."""
    kept: int
    """Of those, the IDs the store kept for a later fetch (the rest are lost, never handed out)."""
    tags: int
    """Tags with unused IDs."""


async def surrender(allocator: TagAllocator, clock: Clock, within: float) -> list[tuple[int, int]]:
    """Close ``allocator`` to takes, and return the IDs its buffer held unused, as inclusive ID ranges.

    The buffer is closed to takes first: from then on no take of this tag hands anything out, so none of
    these IDs can reach a caller. A segment in flight is given ``within`` seconds to land in the buffer (it
    is then returned, not lost); then fetching stops, and the rest is read.
    """
    allocator.refuse(StoreUnavailable("the worker is stopping"), stopping=True)
    buffer = allocator.buffer
    installed, deadline = buffer.stats().fetches, clock.monotonic() + within
    while buffer.fetching and buffer.stats().fetches == installed:
        if not await allocator.changed(deadline):
            break
    await allocator.close()
    stats = buffer.stats()
    held = [] if stats.current is None else [(stats.current.position, stats.current.last)]
    held += [(s.first, s.last) for s in stats.next]
    residue = allocator.residue
    rest = []
    for first, last in held:
        if first <= last:
            ids = residue.ids((first, last))
            rest.append((ids.first, ids.last))
    return rest


async def return_unused(
    allocator: SegmentAllocator, store: SegmentStore, worker: str, clock: Clock, timeout: float
) -> Returned:
    """Close every plain tag's buffer, then give its unused IDs back to ``store`` (one transaction per tag).

    Daily tags' day rows are not returned. A tag whose return fails (or is not done within ``timeout``
    seconds) loses its rest: lost, never repeated. Logged in one line.
    """
    tags = list(allocator.tags.items())
    for _tag, tag_allocator in tags:  # every buffer closed to takes at once, before any await
        tag_allocator.refuse(StoreUnavailable("the worker is stopping"), stopping=True)
    surrendered = await asyncio.gather(*(surrender(a, clock, timeout / 2) for _tag, a in tags))
    rests = {tag: rest for (tag, _a), rest in zip(tags, surrendered, strict=True) if rest}
    offered = sum(_count(a, rest) for (_tag, a), rest in zip(tags, surrendered, strict=True))
    await allocator.close()

    async def give(tag: str, rest: list[tuple[int, int]]) -> int:
        try:
            return await store.return_unused(tag, rest, worker)
        except Exception as exc:  # the stop goes on: what was not returned is lost, never repeated
            log.warning("could not return the unused IDs of %r (%d range(s)): %s", tag, len(rest), exc)
            return 0

    kept = 0
    if rests:
        try:
            counts = await run_within(
                clock, asyncio.gather(*(give(tag, rest) for tag, rest in rests.items())), timeout / 2
            )
            kept = sum(counts)
        except TimeoutError:
            log.warning(
                "returning the unused IDs took over %g s: gave up (they are lost, not repeated)", timeout
            )
    returned = Returned(offered, kept, len(rests))
    if rests:
        log.info(
            "returned %d unused ID(s) of %d tag(s) to the store for the next fetches (%d not kept)",
            kept,
            len(rests),
            offered - kept,
        )
    return returned


def _count(allocator: TagAllocator, rest: list[tuple[int, int]]) -> int:
    stride = allocator.residue.stride
    return sum(StridedRange(first, last, stride).count for first, last in rest)
