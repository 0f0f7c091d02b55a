"""An ordered tag's IDs, strictly increasing across workers and failovers (hypothesis stateful, memory store).

Up to three workers contend for one ordered tag's lease and answer its requests through the owner's own path:
:class:`~dispenser.service.ordered.OrderedTag` (the lease), a fresh allocator over a
:class:`~dispenser.service.ordered.FencedStore` per term (wired as ``dispenser/app/ordered.py`` wires it), a
:class:`~dispenser.service.dispatch.Dispatcher` over :class:`~dispenser.service.ordered.OneTag`, and the
NATS adapter's :class:`~dispenser.adapters.nats.ordered.OrderedRoute` (answer loop, forwarding, the serving
checks), on an in-memory NATS that records every reply in the order it was published. Between requests:
time passes (the lease loops try, callers go on asking), the store goes down and comes back, the owner's
lease loop stalls (it keeps answering what reaches it: deposed, it does not know it yet) or its connection to
the store hangs (grants in flight arrive late), the owner is killed or stopped with SIGTERM and a fresh worker
starts. Time is a :class:`~dispenser.testing.ManualClock` shared by the workers and the lease row (the clock
assumption of docs/ordered.md, without drift: ``tests/unit/test_ordered_lease.py`` covers the drift).

The invariant is the tag's promise (docs/ordered.md): every ID answered, by any worker, in the order
answered, lies above every ID answered before it, those of the tag's plain past included.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from nats.aio.client import Client
from nats.aio.msg import Msg

from dispenser.adapters.nats.micro import ERROR_HEADER
from dispenser.adapters.nats.ordered import OrderedRoute, owner_subject
from dispenser.core.lease import Term
from dispenser.messages import Reply, id_subject
from dispenser.ports import Allocation, SegmentStore, TagInfo
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.ordered import NotOwner, OneTag, OrderedTag, term_allocator
from dispenser.service.segments import AllocatorSettings, TagAllocator
from dispenser.testing import ManualClock, MemorySegmentStore, settle
from tests.unit.test_ordered_lease import MemoryLeases

T = TypeVar("T")

TAG = "invoice"
STEP = 10
TTL = 1.0
PREFIX = "leaf"
FAST = AllocatorSettings(retry_initial=0.2, retry_max=0.5)
LIMITS = Limits(deadline=4.0)
"""A request waits for a segment up to 4 s (``segment.wait_deadline``): longer than a hang, so a deposed
owner's grant in flight arrives while its request still waits."""
_REPLY = msgspec.json.Decoder(Reply)
TURNS = 20
"""Loop turns given to the answers before :func:`settle` checks that nothing is left to run (a speed-up)."""


class Link:
    """One worker's connection to the shared store: grants are made at once, answered while ``gate`` is set.

    What an owner's :class:`~dispenser.service.ordered.FencedStore` calls of a store.
    """

    def __init__(self, store: MemorySegmentStore) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.gate.set()

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        allocation = await self.store.next_segment(tag, step, above=above)
        await self.gate.wait()
        return allocation

    async def list_tags(self) -> list[TagInfo]:
        return await self.store.list_tags()


@dataclass
class Published:
    """A reply as the NATS server received it: who sent it, whether its term served then, and its IDs."""

    worker: str
    serving: bool
    ids: list[int] | None
    """None: an error reply (``unavailable``: refused)."""


class Bus:
    """NATS as the routes use it: plain subscriptions, and every reply in the order it was published."""

    def __init__(self) -> None:
        self.subs: list[Subscription] = []
        self.replies: list[Published] = []
        self._inboxes = itertools.count()

    def request(self, conn: Connection, body: bytes) -> Msg:
        """A caller's request for the tag, as the queue group delivers it to ``conn``'s worker."""
        subject = id_subject(PREFIX, "segment", TAG)
        return Msg(cast("Client", conn), subject=subject, reply=f"_INBOX.{next(self._inboxes)}", data=body)

    async def publish(
        self, conn: Connection, subject: str, payload: bytes, reply: str, headers: object
    ) -> None:
        if not conn.alive:  # a dead process sends nothing
            return
        if subject.startswith("_INBOX."):
            self.replies.append(Published(conn.name, conn.serving(), _ids(payload, headers)))
            return
        for sub in [s for s in self.subs if s.subject == subject and s.conn.alive]:
            await sub.cb(Msg(cast("Client", conn), subject=subject, reply=reply, data=payload))


def _ids(payload: bytes, headers: object) -> list[int] | None:
    if isinstance(headers, dict) and ERROR_HEADER in headers:
        return None
    reply = _REPLY.decode(payload)
    if reply.ranges is not None:
        return [i for first, last in reply.ranges for i in range(first, last + 1)]
    assert reply.ids is not None
    return reply.ids


@dataclass
class Subscription:
    bus: Bus
    conn: Connection
    subject: str
    cb: Callable[[Msg], Awaitable[None]]

    async def unsubscribe(self) -> None:
        if self in self.bus.subs:
            self.bus.subs.remove(self)

    async def drain(self) -> None:
        await self.unsubscribe()


@dataclass
class Connection:
    """One worker's connection to the bus (what :class:`OrderedRoute` calls of nats-py's client)."""

    bus: Bus
    name: str
    serving: Callable[[], bool] = lambda: False
    alive: bool = True

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        await self.bus.publish(self, subject, payload, reply, headers)

    async def subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        sub = Subscription(self.bus, self, subject, cb)
        self.bus.subs.append(sub)
        return sub

    async def flush(self, timeout: float) -> None:
        del timeout


@dataclass
class Worker:
    """One worker's part in the tag: its lease, its route, and every term's allocator (closed at the end)."""

    conn: Connection
    link: Link
    lease: OrderedTag
    route: OrderedRoute
    terms: list[TagAllocator] = field(default_factory=list)
    current: TagAllocator | None = None
    stalled_until: float = 0.0
    """Until when its lease loop does not run (it still answers what reaches it), and, if it hung, its link
    answers no grant."""


class OrderedMachine(RuleBasedStateMachine):
    """Workers answering one ordered tag of step 10 (lease 1 s); every reply checked against those before."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.store = MemorySegmentStore()
        self.leases = MemoryLeases(self.clock, TTL)
        self.bus = Bus()
        self.workers: dict[str, Worker] = {}
        self.gone: list[Worker] = []
        self.stopping: list[asyncio.Task[None]] = []
        self.started = 0
        self.down_until = 0.0
        """Until when PostgreSQL is down (segments and leases, for every worker)."""
        self.before = self.run(self._plain_past())
        self.ordered_ids: list[int] = []
        self.checked = 0
        """Replies already checked by the invariant."""

    def run(self, awaitable: Awaitable[T]) -> T:
        return self.loop.run_until_complete(awaitable)

    def settle(self) -> None:
        self.run(settle())

    async def _plain_past(self) -> int:
        """The tag served plain before: two workers' segments, the first's rest returned, below the second's.

        Returns the highest ID handed out then (12): the ordered tag's first ID must lie above it, so an owner
        that took the returned range 4..10 would step back.
        """
        await self.store.add_tag(TAG, STEP)
        first = (await self.store.next_segment(TAG)).segment
        second = (await self.store.next_segment(TAG)).segment
        handed: list[int] = [*range(first.first, first.first + 3), *range(second.first, second.first + 2)]
        await self.store.return_unused(TAG, [(first.first + 3, first.last)], "plain-worker")
        return max(handed)

    @initialize(workers=st.integers(2, 3))
    def fleet(self, workers: int) -> None:
        """Two or three workers start together."""
        for _ in range(workers):
            self.start()

    def start(self) -> None:
        """A worker starts (a new process with a new holder name: nothing of an earlier one is kept).

        Its lease loop tries at once, as a worker's first try comes at its start.
        """
        name = f"w{self.started}"
        self.started += 1
        conn, link = Connection(self.bus, name), Link(self.store)
        worker: Worker | None = None

        async def on_term(term: Term | None) -> None:  # as dispenser/app/ordered.py's Ordered._on_term
            assert worker is not None
            old, worker.current = worker.current, None
            if term is None:
                await worker.route.end()
            else:
                store = cast("SegmentStore", link)
                allocator = term_allocator(
                    store, self.leases, self.clock, FAST, tag=TAG, holder=name, epoch=term.epoch
                )
                worker.current = allocator
                worker.terms.append(allocator)
                await worker.route.begin(Dispatcher(OneTag(allocator), self.clock, LIMITS))
            if old is not None:
                await old.close(NotOwner(TAG, "its owner's term ended"))

        lease = OrderedTag(TAG, name, self.leases, self.clock, on_term=on_term)
        conn.serving = lease.serving
        errors = Dispatcher(OneTag(TagAllocator(TAG, self.store, self.clock, FAST)), self.clock, LIMITS)
        route = OrderedRoute(
            cast("Client", conn),
            TAG,
            owner_subject(PREFIX, TAG),
            errors=errors,
            serving=lease.serving,
            elsewhere=lambda: lease.elsewhere,
            refusal=lambda: NotOwner(TAG, "no worker owns it at this moment"),
        )
        worker = Worker(conn, link, lease, route)
        self.workers[name] = worker
        self.run(lease.step())
        self.settle()

    @rule(
        requests=st.lists(
            st.tuples(st.integers(0, 2), st.integers(1, 25), st.booleans()), min_size=1, max_size=6
        )
    )
    def ask(self, requests: list[tuple[int, int, bool]]) -> None:
        """Callers' requests, each delivered by the queue group to a worker: answered, forwarded, refused."""
        names = sorted(self.workers)
        self.run(self.deliver([(names[i % len(names)], count, ranges) for i, count, ranges in requests]))

    async def deliver(self, requests: list[tuple[str, int, bool]]) -> None:
        """Requests (worker, count, ranges format) delivered as the queue group would, and what follows."""
        for name, count, ranges in requests:
            worker = self.workers[name]
            body = msgspec.json.encode({"count": count, "format": "ranges" if ranges else "ids"})
            await worker.route.route(self.bus.request(worker.conn, body))
        for _ in range(TURNS):  # the answers run here, outside settle's profile hook (which slows them ~10x)
            await asyncio.sleep(0)
        await settle()

    def send(self, name: str, count: int) -> None:
        """A request for ``count`` IDs to worker ``name``, and whatever it sets off."""
        self.run(self.deliver([(name, count, False)]))

    @rule(data=st.data(), seconds=st.sampled_from([0.1, 0.35, 0.7, 1.2]), load=st.integers(0, 12))
    def time_passes(self, data: st.DataObject, seconds: float, load: int) -> None:
        """Time passes: see :meth:`elapse`, the workers in any order."""
        self.elapse(seconds, load, data.draw(st.permutations(sorted(self.workers))))

    def elapse(self, seconds: float, load: int, order: list[str]) -> None:
        """``seconds`` pass; every ``TTL / 3`` the lease loops not stalled try, then callers ask each worker.

        Leases expire unless renewed, takes waiting for a segment reach their deadline, a hang or an outage
        ends; after each round of tries, each worker in ``order`` gets a request for ``load`` IDs (none:
        ``load`` 0), a stalled (maybe deposed) owner included.
        """
        end = self.clock.monotonic() + seconds
        while (now := self.clock.monotonic()) < end:
            self.run(self._round(min(end - now, TTL / 3), load, order))

    async def _round(self, seconds: float, load: int, order: list[str]) -> None:
        await self.clock.advance(seconds)
        if self.leases.down and self.down_until <= self.clock.monotonic():
            self.leases.down = False
            self.store.set_unavailable(False)
        back = [
            w.link for w in [*self.workers.values(), *self.gone] if w.stalled_until <= self.clock.monotonic()
        ]
        if any(not link.gate.is_set() for link in back):
            for link in back:
                link.gate.set()  # a hung connection is back: the grants in flight arrive first
            await settle()
        running = [name for name in order if name in self.workers]
        for name in running:
            if self.workers[name].stalled_until <= self.clock.monotonic():
                await self.workers[name].lease.step()
        await self.deliver([(name, load, False) for name in running if load])  # and settles

    @rule(
        data=st.data(),
        fault=st.sampled_from(["stall", "stall", "hang", "hang", "kill", "sigterm", "outage"]),
        seconds=st.sampled_from([0.7, 1.2, 1.8, 3.0]),
        then=st.sampled_from([0.0, 1.5, 2.0]),
        load=st.integers(0, 12),
    )
    def fails(self, data: st.DataObject, fault: str, seconds: float, then: float, load: int) -> None:
        """A fault, then ``then`` seconds pass (:meth:`elapse`, with ``load``), the fault's aftermath.

        The owner (with none, any worker) stalls or hangs for ``seconds``, or is replaced by a new process; or
        PostgreSQL goes down for ``seconds``. Stalled, its lease loop does not run; it still answers what
        reaches it (deposed once its lease expires, it does not know it yet). Hung, its connection to the
        store hangs too: the grants it asked for meanwhile arrive at the end, maybe after the next owner's
        answers. Killed (kill -9): it sends nothing more, its lease expires by itself, its buffer is a gap.
        Stopped (SIGTERM, as ``Ordered.stop``): it answers what is queued while its term lasts, then gives the
        lease up; the stop may wait (a grant held back, the store down) across the next rules, as a real one
        does.
        ``outage``: the store (segments and leases) is down for every worker.
        """
        names = sorted(self.workers)
        owners = [n for n in names if self.workers[n].lease.serving()]
        name = owners[0] if owners else data.draw(st.sampled_from(names))
        if fault == "outage":
            self.down_until = self.clock.monotonic() + seconds
            self.leases.down = True
            self.store.set_unavailable()
        elif fault in {"stall", "hang"}:
            self.workers[name].stalled_until = self.clock.monotonic() + seconds
            if fault == "hang":
                self.workers[name].link.gate.clear()
        elif fault == "sigterm":
            self.stop(name)
            self.start()
        else:
            killed = self.workers.pop(name)
            killed.conn.alive = False
            self.gone.append(killed)
            self.settle()
            self.start()
        self.settle()
        self.elapse(then, load, data.draw(st.permutations(sorted(self.workers))))

    def stop(self, name: str) -> None:
        """SIGTERM to worker ``name`` (see :meth:`fails`)."""
        worker = self.workers.pop(name)
        self.gone.append(worker)

        async def stop() -> None:
            await worker.route.stop()
            await worker.lease.give_up()
            worker.conn.alive = False

        self.stopping.append(self.loop.create_task(stop()))
        self.settle()

    @invariant()
    def strictly_increasing(self) -> None:
        """Each reply's IDs lie above every ID answered before (plain past included), and came from a term."""
        for reply in self.bus.replies[self.checked :]:
            if reply.ids is None:
                continue
            assert reply.serving, f"{reply.worker} answered {reply.ids} outside its term"
            last = self.ordered_ids[-1] if self.ordered_ids else self.before
            assert reply.ids[0] > last, f"{reply.worker} answered {reply.ids} after {last}"
            assert reply.ids == sorted(set(reply.ids)), (
                f"{reply.worker}'s reply is not increasing: {reply.ids}"
            )
            self.ordered_ids += reply.ids
        self.checked = len(self.bus.replies)

    def teardown(self) -> None:
        self.store.set_unavailable(False)
        for task in self.stopping:
            task.cancel()
        for worker in [*self.workers.values(), *self.gone]:
            worker.conn.alive = False
            worker.link.gate.set()
            loop_task = worker.route._loop  # a crashed process's loop dies with it
            if loop_task is not None:
                loop_task.cancel()
            for allocator in worker.terms:
                self.run(allocator.close())
        self.run(settle())
        self.loop.close()


OrderedMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestOrdered = OrderedMachine.TestCase


def test_a_deposed_owner_refuses_what_it_still_holds() -> None:
    """The machine reaches what it guards: an owner whose lease loop stalled holds IDs below the next owner's.

    It is asked after the next owner answered: it refuses (its term ran out by its own clock), and its buffer,
    which the refusal kept back, lies below what was answered. Then a SIGTERM hand-over: the next owner above.
    """
    machine = OrderedMachine()
    try:
        machine.fleet(2)  # w0 takes the lease at its start, w1 finds it held
        a, b = machine.workers["w0"], machine.workers["w1"]
        machine.send("w1", 3)  # forwarded to the owner
        assert (a.route.answered, b.route.forwarded) == (1, 1)
        machine.run(machine.clock.advance(TTL))  # a's loop stalls: its lease expires unrenewed
        machine.run(b.lease.step())
        assert (a.lease.serving(), b.lease.serving()) == (False, True)
        machine.send("w1", 2)
        machine.send("w0", 1)  # a still thinks it owns the tag: its answer loop gets the request
        machine.strictly_increasing()
        assert [r.ids is None for r in machine.bus.replies] == [False, False, True]
        assert machine.ordered_ids == [21, 22, 23, 34, 35]  # above the plain past's 12, and its return
        assert a.current is not None
        assert machine.run(_take_now(a.current)) < 35  # what the refusal kept back
        machine.run(a.lease.step())  # a sees it lost the lease: its term ends
        assert a.lease.term is None
        assert a.current is None
        machine.stop("w1")  # SIGTERM: b gives the lease up, a takes it at its next try
        machine.run(a.lease.step())
        machine.send("w0", 1)
        machine.strictly_increasing()
        assert (machine.bus.replies[-1].worker, machine.leases.epoch) == ("w0", 3)
        assert machine.ordered_ids[-1] > 35
    finally:
        machine.teardown()


def test_a_grant_that_arrives_after_the_failover_is_never_answered() -> None:
    """An owner's connection hangs with a grant in flight; the next owner answers; the grant comes: a gap.

    The fence (the grant's lease check) and the route's last check both refuse it; without both, the request
    would be answered 21..23 after the next owner's 24.
    """
    machine = OrderedMachine()
    try:
        machine.fleet(2)
        a = machine.workers["w0"]
        a.stalled_until = machine.clock.monotonic() + 1.5  # its connection hangs: no renewal, no grant back
        a.link.gate.clear()
        machine.send("w0", 3)  # its first segment is granted (21..23) and held back
        assert machine.bus.replies == []
        machine.elapse(1.2, 0, ["w0", "w1"])  # the lease expires unrenewed: w1 takes it
        machine.send("w1", 2)
        machine.elapse(0.35, 0, ["w0", "w1"])  # the hang ends: the grant arrives, then w0's loop runs
        machine.strictly_increasing()
        assert [(r.worker, r.ids) for r in machine.bus.replies] == [("w1", [24, 25]), ("w0", None)]
        assert a.lease.term is None
    finally:
        machine.teardown()


async def _take_now(allocator: TagAllocator) -> int:
    batch = allocator.try_take(1)
    assert batch is not None
    return batch.ranges[0][0]
