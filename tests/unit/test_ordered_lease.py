"""Ordered tags' leases (issue 31 item 3): the holder's timing, and never two owners at once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.errors import StoreUnavailable
from dispenser.core.lease import DRIFT, MIN_TTL, LeaseTiming, Term
from dispenser.ports import Allocation
from dispenser.service.ordered import ABOVE_EVERY_RETURN, FencedStore, NotOwner, OrderedTag
from dispenser.testing import ManualClock, MemorySegmentStore

ttls = st.floats(min_value=MIN_TTL, max_value=600.0)


@given(ttl=ttls, sent=st.floats(min_value=0, max_value=1e9), ratio=st.floats(1 / (1 + DRIFT), 1 + DRIFT))
def test_the_holder_stops_before_the_store_can_expire_the_lease(
    ttl: float, sent: float, ratio: float
) -> None:
    """With clock rates up to DRIFT apart, the holder's last answer comes a margin before the store's expiry.

    In real time: the store's expiry is ttl of its own seconds after the statement arrived, after ``sent``.
    """
    timing = LeaseTiming(ttl)
    holder_rate, store_rate = 1.0, ratio  # clock seconds per real second
    last_answer = sent + (timing.serving_until(sent) - sent) / holder_rate
    expiry = sent + ttl / store_rate
    assert last_answer + timing.margin / (1 + DRIFT) <= expiry * (1 + 1e-12)


@given(ttl=ttls)
def test_two_renewals_fit_in_a_term(ttl: float) -> None:
    """A term lasts long enough for two renewals before its margin: one failed try does not end it."""
    timing = LeaseTiming(ttl)
    assert 2 * timing.renew_every < timing.serving_until(0.0)


def test_a_lease_shorter_than_the_minimum_is_refused() -> None:
    """The table's CHECK, mirrored."""
    with pytest.raises(ValueError, match="at least"):
        LeaseTiming(MIN_TTL / 2)


class MemoryLeases:
    """One tag's lease row, timed by the store's clock (the test's ManualClock)."""

    def __init__(self, clock: ManualClock, ttl: float) -> None:
        self.clock, self.ttl = clock, ttl
        self.holder: str | None = None
        self.epoch = 0
        self.expires = float("-inf")
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("down")

    def _held(self, holder: str, epoch: int) -> bool:
        return self.holder == holder and self.epoch == epoch and self.expires > self.clock.monotonic()

    async def take(self, tag: str, holder: str) -> tuple[int, float] | None:
        self._check()
        if self.expires > self.clock.monotonic():
            return None
        self.holder, self.epoch, self.expires = holder, self.epoch + 1, self.clock.monotonic() + self.ttl
        return self.epoch, self.ttl

    async def renew(self, tag: str, holder: str, epoch: int) -> float | None:
        self._check()
        if not self._held(holder, epoch):
            return None
        self.expires = self.clock.monotonic() + self.ttl
        return self.ttl

    async def give_up(self, tag: str, holder: str, epoch: int) -> bool:
        self._check()
        if not self._held(holder, epoch):
            return False
        self.expires = self.clock.monotonic()
        return True

    async def holds(self, tag: str, holder: str, epoch: int) -> bool:
        self._check()
        return self._held(holder, epoch)


async def no_term(term: Term | None) -> None:
    del term


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "down", "up"]), st.floats(min_value=0.0, max_value=2.0)),
        max_size=40,
    )
)
async def test_never_two_owners_serving_at_once(steps: list[tuple[str, float]]) -> None:
    """At no moment do two holders both think they may answer.

    Whatever the order of tries (an owner that stops trying: a crash or a pause), store outages and time.
    """
    clock = ManualClock()
    leases = MemoryLeases(clock, ttl=1.0)
    tags = {name: OrderedTag("t", name, leases, clock, on_term=no_term) for name in "abc"}
    for who, seconds in steps:
        if who == "down":
            leases.down = True
        elif who == "up":
            leases.down = False
        else:
            await tags[who].step()
        assert sum(t.serving() for t in tags.values()) <= 1
        await clock.advance(seconds)  # the holders' and the store's clocks together (drift: above)
        assert sum(t.serving() for t in tags.values()) <= 1


async def test_a_given_up_lease_is_taken_at_once() -> None:
    """SIGTERM's hand-over: the next holder need not wait for the expiry."""
    clock = ManualClock()
    leases = MemoryLeases(clock, ttl=3.0)
    a, b = (OrderedTag("t", name, leases, clock, on_term=no_term) for name in "ab")
    await a.step()
    assert a.serving()
    await b.step()
    assert not b.serving()
    await a.give_up()
    assert not a.serving()
    await b.step()
    assert b.serving()
    assert leases.epoch == 2


async def test_a_deposed_owner_gets_no_segment() -> None:
    """The fence: once the lease of its epoch is lost, the owner's fetch raises and its segment is a gap."""
    clock = ManualClock()
    leases = MemoryLeases(clock, ttl=1.0)
    store = MemorySegmentStore()
    await store.add_tag("t", 10)
    assert await leases.take("t", "a") == (1, 1.0)
    fenced = FencedStore(store, leases, "t", "a", 1)
    first: Allocation = await fenced.next_segment("t")
    await clock.advance(1.0)
    assert await leases.take("t", "b") == (2, 1.0)
    with pytest.raises(NotOwner, match="epoch 1"):
        await fenced.next_segment("t")
    second = await FencedStore(store, leases, "t", "b", 2).next_segment("t")
    assert second.segment.first > first.segment.last + 10  # the deposed owner's segment was skipped


async def test_an_owner_never_takes_a_returned_range() -> None:
    """A range returned unused lies below IDs already handed out: the owner asks above every one."""
    clock = ManualClock()
    leases = MemoryLeases(clock, ttl=1.0)
    store = MemorySegmentStore()
    await store.add_tag("t", 10)
    granted = await store.next_segment("t")
    await store.return_unused("t", [(granted.segment.first, granted.segment.last)], "w")
    await leases.take("t", "a")
    fresh = await FencedStore(store, leases, "t", "a", 1).next_segment("t")
    assert fresh.segment.first > granted.segment.last
    assert ABOVE_EVERY_RETURN == 2**63 - 1
