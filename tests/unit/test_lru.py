"""The bounded meter table (issue 33, item 6): bounded, every key in use gets a slot, newcomers give way first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.lru import ProtectedLru
from dispenser.core.step import StepPolicy
from dispenser.messages import RateEvent
from dispenser.service.rates import MAX_SNOWFLAKE_METERS, RateBook, RateSettings
from dispenser.testing.clock import ManualClock


def use(table: ProtectedLru[str, int], key: str, now: float) -> tuple[str, int] | None:
    """What the rate book does for a request: the key's entry, added if missing; returns what was evicted."""
    if table.get(key, now) is not None:
        return None
    return table.add(key, 0, now)


@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 12), st.sampled_from([0.0, 0.3, 1.0, 2.5])), max_size=80),
)
def test_bounded_every_key_used_has_a_slot_and_established_ones_go_last(
    capacity: int, steps: list[tuple[int, float]]
) -> None:
    """Any history of uses: bounded, the key just used is in, established entries go only when no newcomer is."""
    table: ProtectedLru[str, int] = ProtectedLru(capacity)
    now = 0.0
    for key_number, later in steps:
        now += later
        key = f"k{key_number}"
        newcomers = [k for k, _ in table.items() if not table.established(k)]
        evicted = use(table, key, now)
        assert len(table) <= capacity
        assert key in table
        if evicted is not None and evicted[0] not in newcomers:
            assert newcomers == []


def test_a_flood_of_new_names_evicts_at_most_one_established_entry() -> None:
    """A full table of tags used in two seconds; 10,000 names used once each: one established tag is lost."""
    table: ProtectedLru[str, int] = ProtectedLru(8)
    for now in (0.0, 1.0):
        for i in range(8):
            use(table, f"real-{i}", now)
    assert all(table.established(f"real-{i}") for i in range(8))
    for i in range(10_000):
        use(table, f"junk-{i}", 2.0 + i / 1000)
    real = [k for k, _ in table.items() if k.startswith("real-")]
    assert real == [f"real-{i}" for i in range(1, 8)]  # the least recently used one gave way, once
    assert len(table) == 8


def test_idle_entries_expire_newcomers_sooner() -> None:
    """Newcomers idle past their limit go, established entries only past theirs; each is used to its second's end."""
    table: ProtectedLru[str, int] = ProtectedLru(4)
    use(table, "junk", 0.2)
    use(table, "real", 0.5)
    use(table, "real", 1.5)
    assert table.expire(60.9, newcomer_idle=60, established_idle=600) == []  # junk in use until 1.0
    assert table.expire(61.0, newcomer_idle=60, established_idle=600) == [("junk", 0)]
    assert table.expire(601.9, newcomer_idle=60, established_idle=600) == []
    assert table.expire(602.0, newcomer_idle=60, established_idle=600) == [("real", 0)]
    assert len(table) == 0


def test_a_capacity_must_be_positive_and_a_key_added_once() -> None:
    """A zero capacity is refused, and so is adding a key that is in."""
    with pytest.raises(ValueError, match="capacity"):
        ProtectedLru(0)
    table: ProtectedLru[str, int] = ProtectedLru(1)
    table.add("a", 1, 0.0)
    with pytest.raises(KeyError):
        table.add("a", 2, 0.0)


@pytest.mark.parametrize("via", ["record", "record_snowflake"])
async def test_the_book_meters_a_real_tag_after_600_junk_ones_and_forgets_the_junk(via: str) -> None:
    """600 junk snowflake tags, then `order` in two seconds: metered, kept through a flood; the junk forgotten.

    The table stays bounded, and a junk tag (one request) is forgotten a window after it, peers' events too.
    Alike through ``record("snowflake", …)`` and ``record_snowflake`` (the generator's hot path).
    """
    clock = ManualClock()
    book = RateBook(clock, RateSettings(window=60), StepPolicy(), worker="w")
    if via == "record_snowflake":
        book.record = lambda kind, tag, ids: book.record_snowflake(tag, ids)  # type: ignore[method-assign]
    for i in range(600):
        book.record("snowflake", f"junk-{i}", 1)
    for _ in range(2):
        book.record("snowflake", "order", 5)
        await clock.advance(1.0)
    assert book.count("snowflake") == MAX_SNOWFLAKE_METERS
    assert book.meter("snowflake", "order").ids_issued == 10
    for i in range(600, 2000):
        book.record("snowflake", f"junk-{i}", 1)
    assert book.known("snowflake", "order")
    events = {e.tag: e for e in book.events(None)}
    assert events["order"].ids_total == 10
    assert events["order"].ids_per_s > 0
    book.observe(
        RateEvent(
            tag="junk-1999",
            kind="snowflake",
            worker="peer",
            time=0.0,
            window_s=60,
            ids_per_s=1.0,
            requests_per_s=1.0,
            peak_ids_per_s=1.0,
        )
    )
    await clock.advance(61.0)
    book.sweep()
    assert [tag for (_, tag), _ in book.meters()] == ["order"]
    assert book.peers("snowflake", "junk-1999") == []
