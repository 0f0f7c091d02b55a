"""Ordered tags: one owner at a time by a lease, the owner's segments fenced by its epoch (docs/ordered.md).

:class:`OrderedTag` takes and renews one tag's lease on a timer and says whether this worker may answer;
each holding (a :class:`~dispenser.core.lease.Term`) gets a fresh allocator over a :class:`FencedStore`,
so that a new owner starts from a new segment above every grant and the old owner's unused buffer is a gap.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol

from dispenser.core.daily import DailyPolicy
from dispenser.core.errors import DispenserError, Unavailable
from dispenser.core.ids import IdBatch, Kind
from dispenser.core.lease import LeaseTiming, Term
from dispenser.ports import Allocation, Clock, SegmentStore, TagInfo
from dispenser.service.segments import AllocatorSettings, TagAllocator

__all__ = ["ABOVE_EVERY_RETURN", "FencedStore", "Forwarded", "NotOwner", "OneTag", "OrderedTag", "TagLeases"]

log = logging.getLogger(__name__)

ABOVE_EVERY_RETURN: Final = 2**63 - 1
"""``above`` for the owner's fetches: no range returned unused (lower than IDs already given) is taken."""


class NotOwner(Unavailable):
    """This worker does not answer the ordered tag now (another owns it, or nobody does yet): retry."""

    def __init__(self, tag: str, why: str) -> None:
        """``why``: who owns it, or that nobody does."""
        super().__init__(f"ordered tag {tag!r}: {why}; retry (docs/ordered.md)")


class TagLeases(Protocol):
    """Where ordered tags' leases are kept (PostgreSQL's ``dispenser_tag_ordered``)."""

    async def take(self, tag: str, holder: str) -> tuple[int, float] | None:
        """The new epoch and lease seconds if the lease had expired; None: still held."""
        ...

    async def renew(self, tag: str, holder: str, epoch: int) -> float | None:
        """The lease seconds if still held and now extended; None: lost."""
        ...

    async def give_up(self, tag: str, holder: str, epoch: int) -> bool:
        """End the lease now; False: it was not held any more."""
        ...

    async def holds(self, tag: str, holder: str, epoch: int) -> bool:
        """Whether the lease of ``epoch`` is still ``holder``'s."""
        ...


class FencedStore:
    """A :class:`~dispenser.ports.SegmentStore` for one owner's term: each segment checked against its epoch.

    The lease is checked *after* the grant, in a second round trip: a take of the lease that commits before
    the check is seen by it (the segment is then never handed out: a gap); one that commits after it came
    after the grant, so the next owner's first segment lies above this one. Only fresh segments are taken
    (``above``): a range returned unused lies below IDs already handed out.
    """

    def __init__(self, store: SegmentStore, leases: TagLeases, tag: str, holder: str, epoch: int) -> None:
        """Fetch ``tag``'s segments from ``store`` while ``holder`` holds the lease of ``epoch``."""
        self._store, self._leases = store, leases
        self._tag, self._holder, self._epoch = tag, holder, epoch

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        """A fresh segment, or NotOwner when the lease of this term is no longer held (the segment is a gap)."""
        del above  # a returned range is never taken: it lies below IDs already handed out
        allocation = await self._store.next_segment(tag, step, above=ABOVE_EVERY_RETURN)
        if tag != self._tag or not await self._leases.holds(tag, self._holder, self._epoch):
            raise NotOwner(tag, f"the lease of epoch {self._epoch} is lost; its last segment is skipped")
        return allocation

    async def return_unused(self, tag: str, ranges: Sequence[tuple[int, int]], worker: str) -> int:
        """Nothing is given back: a returned range would be handed out below IDs already answered."""
        del tag, ranges, worker
        return 0

    async def list_tags(self) -> list[TagInfo]:
        """The store's."""
        return await self._store.list_tags()

    async def add_tag(self, *args: object, **kwargs: object) -> TagInfo:
        """Not for an owner: tags are added with ``dispenser tag add``."""
        raise NotImplementedError

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Not for an owner."""
        raise NotImplementedError

    async def set_daily(self, tag: str, daily: DailyPolicy) -> TagInfo:
        """Not for an owner."""
        raise NotImplementedError

    async def set_permuted(self, tag: str, permuted: bool) -> TagInfo:
        """Not for an owner."""
        raise NotImplementedError

    async def remove_tag(self, tag: str) -> None:
        """Not for an owner."""
        raise NotImplementedError

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Not for an owner: the worker's own allocator saves them."""

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """None here."""
        return {}

    async def close(self) -> None:
        """The store is the worker's: left open."""


class OneTag:
    """An :class:`~dispenser.ports.IdSource` of one tag's allocator (an owner's term)."""

    def __init__(self, allocator: TagAllocator) -> None:
        """Serve ``allocator``'s tag."""
        self.allocator = allocator

    def try_take(self, tag: str, count: int) -> IdBatch | None:
        """IDs at hand, or None (then :meth:`take`)."""
        return self.allocator.try_take(count) if tag == self.allocator.tag else None

    async def take(self, tag: str, count: int, deadline: float) -> IdBatch:
        """IDs, waiting for a segment until ``deadline``."""
        if tag != self.allocator.tag:
            raise NotOwner(tag, "not this term's tag")
        return await self.allocator.take(count, deadline)


Forward = Callable[[str, int, float], Awaitable[list[tuple[int, int]]]]
"""Asks the owner for ``count`` IDs of a tag within ``timeout`` seconds: inclusive ranges, in order."""


class Forwarded(TagAllocator):
    """An ordered tag on the worker's plain path (HTTP, Kafka): never a buffer, each take asks the owner.

    It stands in the worker's :class:`~dispenser.service.segments.SegmentAllocator` for the tag, so that the
    dispatcher's hot path is unchanged for every other tag: :meth:`try_take` is always short, and
    :meth:`take` forwards (over NATS, where the owner answers in order).
    """

    def __init__(
        self, tag: str, store: SegmentStore, clock: Clock, settings: AllocatorSettings, forward: Forward
    ) -> None:
        """Forward ``tag``'s takes with ``forward``."""
        super().__init__(tag, store, clock, settings)
        self._forward = forward

    def try_take(self, count: int) -> IdBatch | None:
        """Never at hand: the owner's buffer is elsewhere."""
        del count
        return None

    async def take(self, count: int, deadline: float) -> IdBatch:
        """Ask the owner (Unavailable when it does not answer before ``deadline``)."""
        if self.refusal is not None:
            raise self.refusal
        ranges = await self._forward(self.tag, count, deadline - self._clock.monotonic())
        return IdBatch(tuple(ranges))


def term_allocator(
    store: SegmentStore,
    leases: TagLeases,
    clock: Clock,
    settings: AllocatorSettings,
    *,
    tag: str,
    holder: str,
    epoch: int,
) -> TagAllocator:
    """A fresh allocator for one term: an empty buffer, its first segment above every grant so far."""
    return TagAllocator(tag, FencedStore(store, leases, tag, holder, epoch), clock, settings)


class OrderedTag:
    """One ordered tag's lease on this worker: taken when free, renewed while held, given up at a stop."""

    def __init__(
        self,
        tag: str,
        holder: str,
        leases: TagLeases,
        clock: Clock,
        *,
        on_term: Callable[[Term | None], Awaitable[None]],
    ) -> None:
        """Contend for ``tag``'s lease as ``holder``.

        Args:
            tag: the ordered tag.
            holder: this worker's name in the lease (unique per run).
            leases: the store of leases.
            clock: the clock (monotonic readings, and the sleeps between tries).
            on_term: awaited at each new term, and (None) at its end, in order.
        """
        self.tag, self.holder = tag, holder
        self._leases, self._clock = leases, clock
        self._on_term = on_term
        self.term: Term | None = None
        self.timing = LeaseTiming(3.0)
        """The lease's timing (its seconds from the row, once read)."""
        self.stopped = False
        self.elsewhere = False
        """Whether another worker held the lease when last seen (this worker's last take, or a read)."""

    def serving(self) -> bool:
        """Whether this worker may answer the tag now (it holds an unexpired term, by its own clock)."""
        term = self.term
        return term is not None and term.serving(self._clock.monotonic())

    async def step(self) -> None:
        """One try: take the lease if free, or renew it if held (a store failure: the term runs out)."""
        term = self.term
        sent = self._clock.monotonic()
        try:
            if term is None:
                taken = await self._leases.take(self.tag, self.holder)
                self.elsewhere = taken is None
                if taken is not None and not self.stopped:
                    epoch, ttl = taken
                    self.timing = LeaseTiming(ttl)
                    await self._begin(Term(epoch, self.timing.serving_until(sent)))
                elif taken is not None:  # stopping meanwhile: hand it straight on
                    await self._leases.give_up(self.tag, self.holder, taken[0])
                return
            ttl_now = await self._leases.renew(self.tag, self.holder, term.epoch)
        except DispenserError as exc:
            log.warning(
                "ordered tag %r: the lease could not be taken or renewed (will retry): %s", self.tag, exc
            )
            if term is not None and not term.serving(self._clock.monotonic()):
                await self._end("its lease ran out unrenewed")
            return
        if self.term is not term:
            return  # ended meanwhile (a stop)
        if ttl_now is None:
            await self._end("its lease was lost")
            return
        self.timing = LeaseTiming(ttl_now)
        self.term = Term(term.epoch, self.timing.serving_until(sent))

    async def _begin(self, term: Term) -> None:
        log.info("ordered tag %r: this worker owns it now (epoch %d)", self.tag, term.epoch)
        self.term = term
        await self._on_term(term)

    async def _end(self, why: str) -> None:
        term = self.term
        if term is None:
            return
        log.warning("ordered tag %r: no longer its owner (epoch %d): %s", self.tag, term.epoch, why)
        self.term = None
        await self._on_term(None)

    async def run(self) -> None:
        """Try every :attr:`LeaseTiming.renew_every` seconds until cancelled."""
        while not self.stopped:
            await self.step()
            await self._clock.sleep(self.timing.renew_every)

    async def give_up(self) -> None:
        """Stop contending; end the term and give the lease up (the caller answers no more before this)."""
        self.stopped = True
        term = self.term
        if term is None:
            return
        await self._end("the worker is stopping")
        try:
            await self._leases.give_up(self.tag, self.holder, term.epoch)
        except DispenserError as exc:
            log.warning(
                "ordered tag %r: could not give the lease up (it expires by itself): %s", self.tag, exc
            )
        else:
            log.info("ordered tag %r: lease given up (epoch %d) for the next owner", self.tag, term.epoch)
