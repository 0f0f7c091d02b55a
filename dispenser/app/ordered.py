"""A worker's ordered tags: found in the store, forwarded from the plain path, owned in turn over NATS.

Every ``POLL`` seconds the worker reads ``dispenser_tag_ordered``: a tag found there gets a stand-in in the
worker's own allocator (HTTP and Kafka ask the owner over NATS; without NATS, ``unavailable``), is
contended for by its lease, and routed on NATS (its owner answers, the others forward): docs/ordered.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Final

from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.ordered import OrderedRoute, forward_over_nats, owner_subject
from dispenser.adapters.postgres.ordered import PostgresLeases
from dispenser.app.parts import settings_of
from dispenser.app.segments import Segments
from dispenser.app.stopping import background
from dispenser.config import Config
from dispenser.core.errors import DispenserError
from dispenser.core.lease import Term
from dispenser.ports import Clock, IdSource
from dispenser.service.dispatch import Dispatcher
from dispenser.service.ordered import Forwarded, NotOwner, OneTag, OrderedTag, term_allocator
from dispenser.service.segments import AllocatorSettings, TagAllocator

__all__ = ["FIRST_READ", "POLL", "Ordered", "start_ordered"]

log = logging.getLogger("dispenser.app")

POLL: Final = 1.0
"""Seconds between reads of the ordered tags and their holders (a new ordered tag is taken in within this)."""

FIRST_READ: Final = 0.05
"""Seconds between tries of the first read, after a start without PostgreSQL: the plain path learns the tags
from the same database, so this keeps the window in which it could answer an ordered tag short
(docs/ordered.md, "What is not built yet")."""


class Ordered:
    """The ordered tags this worker knows: their routes on NATS (by tag) and their leases."""

    def __init__(
        self,
        config: Config,
        clock: Clock,
        nc: Connection | None,
        segments: Segments,
        *,
        dispatcher: Dispatcher,
        answerer: Callable[[IdSource], Dispatcher],
    ) -> None:
        """See :func:`start_ordered`."""
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        """This worker's name in the leases (host, pid and a random suffix: unique per run)."""
        self.routes: dict[str, OrderedRoute] = {}
        """By tag: what the NATS endpoint does with its requests (a live mapping: tags join it)."""
        self.tags: dict[str, OrderedTag] = {}
        self.known: set[str] = set()
        """Every ordered tag seen (off the plain path), with or without NATS."""
        self.terms: dict[str, TagAllocator] = {}
        """The current term's allocator of each tag this worker owns."""
        self._config, self._clock, self._nc = config, clock, nc
        self._segments, self._dispatcher, self._answerer = segments, dispatcher, answerer
        self._leases = PostgresLeases(segments.store)
        self._settings = settings_of(AllocatorSettings, config.segment)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.read = False
        """Whether the ordered tags were read once (until then a start without PostgreSQL knows none)."""
        self._route_of: dict[str, OrderedRoute] = {}  # ``routes`` as the lease loop sees them (see release)

    async def adopt(self, tag: str) -> None:
        """Take ``tag`` off the plain path, then (with NATS) route it and contend for its lease.

        Without NATS the plain path refuses it; with NATS the plain path (HTTP, Kafka) asks the owner over
        NATS, through a :class:`Forwarded` stand-in in the worker's allocator.
        """
        nc, plain = self._nc, self._segments.allocator
        with contextlib.suppress(DispenserError):
            await plain.resolve(tag)
        if nc is None:
            plain.refuse(tag, NotOwner(tag, "this worker has no NATS (nats.enabled) to reach its owner"))
            self.known.add(tag)
            return
        old = plain.tags.get(tag)
        forward = forward_over_nats(nc, self._config.nats.subject_prefix)
        # The allocator's own table: its refreshes keep the stand-in, a removal of the tag drops it.
        plain.tags[tag] = Forwarded(tag, self._segments.store, self._clock, self._settings, forward)
        if old is not None:  # anything it held is a gap: never handed out
            old.refuse(NotOwner(tag, "the tag is ordered"))
            await old.close()
        self.known.add(tag)
        lease = OrderedTag(
            tag, self.holder, self._leases, self._clock, on_term=lambda term: self._on_term(tag, term)
        )
        self.routes[tag] = self._route_of[tag] = OrderedRoute(
            nc,
            tag,
            owner_subject(self._config.nats.subject_prefix, tag),
            errors=self._dispatcher,
            serving=lease.serving,
            elsewhere=lambda: lease.elsewhere,
            refusal=lambda: NotOwner(tag, "no worker owns it at this moment"),
        )
        self.tags[tag] = lease
        self._tasks[tag] = asyncio.create_task(lease.run(), name=f"ordered-lease-{tag}")

    async def _on_term(self, tag: str, term: Term | None) -> None:
        """A term begins (a fresh allocator, answered from) or ends (its allocator closed: a gap)."""
        old = self.terms.pop(tag, None)
        route = self._route_of[tag]
        if term is None:
            await route.end()
        else:
            allocator = term_allocator(
                self._segments.store,
                self._leases,
                self._clock,
                self._settings,
                tag=tag,
                holder=self.holder,
                epoch=term.epoch,
            )
            self.terms[tag] = allocator
            await route.begin(self._answerer(OneTag(allocator)))
        if old is not None:  # its unused buffer is a gap: never handed out again
            await old.close(NotOwner(tag, "its owner's term ended"))

    async def poll(self) -> None:
        """Read the ordered tags and their holders: adopt new ones, say whether another worker owns each."""
        rows = await self._leases.ordered()
        self.read = True
        for tag in self.known - rows.keys():
            await self.release(tag)
        for tag, row in rows.items():
            if tag not in self.known:
                await self.adopt(tag)
            lease = self.tags.get(tag)
            if lease is not None:
                lease.elsewhere = row.held and row.holder != self.holder

    async def release(self, tag: str) -> None:
        """``tag`` is ordered no more (``tag set --plain``, or removed): back to the plain path, at once.

        Its requests go to the worker's dispatcher again, which learns the tag anew (a fresh allocator, its
        first segment above every grant); the term's allocator, if this worker owned the tag, is closed.
        """
        route = self.routes.pop(tag, None)  # first: the NATS endpoint stops routing to it
        task = self._tasks.pop(tag, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if route is not None:
            await route.stop()
            await self.tags.pop(tag).give_up()  # ends the term (its row is gone: nothing to give up)
            del self._route_of[tag]
        stand_in = self._segments.allocator.tags.pop(tag, None)
        if stand_in is not None:
            await stand_in.close()
        self.known.discard(tag)
        log.info("tag %r is no longer ordered: served on the plain path", tag)

    async def keep_polling(self) -> None:
        """:meth:`poll` every :data:`POLL` seconds (every :data:`FIRST_READ` until one read has succeeded)."""
        while True:
            await self._clock.sleep(POLL if self.read else FIRST_READ)
            try:
                await self.poll()
            except DispenserError as exc:
                log.debug("could not read the ordered tags (will retry): %s", exc)

    async def stop(self) -> None:
        """Contend no more; answer what each route holds, then give each lease up for the next owner."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for tag, route in self.routes.items():
            await route.stop()
            await self.tags[tag].give_up()


async def start_ordered(
    stack: contextlib.AsyncExitStack,
    config: Config,
    clock: Clock,
    nc: Connection | None,
    segments: Segments,
    *,
    dispatcher: Dispatcher,
    answerer: Callable[[IdSource], Dispatcher],
) -> Ordered:
    """Find the ordered tags now (before serving), then every :data:`POLL` seconds; stop them on unwind.

    Args:
        stack: where the stop goes (unwound after the NATS service's drain: the queued requests are
            answered, then the leases given up).
        config: the configuration.
        clock: the clock.
        nc: the NATS connection (None: ordered tags are refused here, never owned).
        segments: the worker's allocator (refuses ordered tags) and store.
        dispatcher: the worker's segment dispatcher (formats error answers).
        answerer: builds a term's dispatcher over its one-tag source.
    """
    ordered = Ordered(config, clock, nc, segments, dispatcher=dispatcher, answerer=answerer)
    stack.push_async_callback(ordered.stop)
    try:
        await ordered.poll()
    except DispenserError as exc:
        # Without PostgreSQL at start the pool has said so once already (app.segments.open_postgres).
        say = log.warning if segments.store.connected else log.debug
        say("could not read the ordered tags yet (will retry every %g s): %s", FIRST_READ, exc)
    if ordered.known:
        log.info("ordered tags (one owner at a time, docs/ordered.md): %s", ", ".join(sorted(ordered.known)))
    background(stack, ordered.keep_polling(), "ordered-tags")
    return ordered
