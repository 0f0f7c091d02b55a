"""The guard against two databases serving one tag in intersecting residue classes: who refuses, on what."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.errors import ResidueOverlap
from dispenser.core.residue import LEAF, Residue
from dispenser.core.residue_claims import Database, ResidueClaim, ResidueState, clashes
from dispenser.service.residues import ResidueGuard

A = Database("7001", "leaf")
B = Database("7002", "leaf")


class Guard:
    """A guard on database A, with what it announced and refused."""

    def __init__(self, database: Database = A, worker: str = "me") -> None:
        self.announced: list[ResidueClaim] = []
        self.refused: list[tuple[str, ResidueOverlap]] = []

        async def read() -> Database:
            return database

        async def announce(claims: list[ResidueClaim]) -> None:
            self.announced.extend(claims)

        self.guard = ResidueGuard(
            worker, read, announce, datacenter="dc-a", on_refuse=lambda t, e: self.refused.append((t, e))
        )


def claim(
    residue: Residue,
    *,
    database: Database = B,
    state: ResidueState = "serving",
    issued: bool = True,
    worker: str = "peer",
    tag: str = "order",
) -> ResidueClaim:
    return ResidueClaim(tag, database, residue, worker, state, issued, "dc-b")


async def test_a_tag_claimed_by_another_database_in_an_intersecting_class_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """0 mod 2 here, 0 mod 2 served on B: refused before any ID, naming both databases; the refusal is announced."""
    g = Guard()
    await g.guard.heard([claim(Residue(2, 0))])
    with caplog.at_level(logging.ERROR), pytest.raises(ResidueOverlap) as caught:
        await g.guard.claim("order", Residue(2, 0))
    error = caught.value
    assert (error.code, error.retryable, error.status) == ("residue_overlap", False, 409)
    assert "of PostgreSQL system 7001" in error.message
    assert "of PostgreSQL system 7002" in error.message
    assert "worker peer in dc-b" in error.message
    assert "IDs 2, 4, 6, … are in both" in error.message
    assert g.guard.refusal("order") is error
    assert [(c.state, c.issued) for c in g.announced] == [("refused", False)]
    assert error.message in caplog.text
    assert g.refused == []  # raised by claim(): the caller stops the tag


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [(Residue(2, 0), Residue(3, 1)), (LEAF, Residue(2, 1)), (Residue(4, 3), LEAF)],
)
async def test_every_intersection_is_refused(mine: Residue, theirs: Residue) -> None:
    """Different strides whose classes meet, a plain tag beside a strided one, either way round."""
    g = Guard()
    await g.guard.heard([claim(theirs)])
    with pytest.raises(ResidueOverlap):
        await g.guard.claim("order", mine)


async def test_disjoint_classes_same_database_and_other_tags_are_served() -> None:
    """2:1 beside 2:0; the same database (its workers share the row); another tag: all claimed as serving."""
    g = Guard()
    await g.guard.heard(
        [claim(Residue(2, 1)), claim(Residue(2, 0), database=A, worker="sibling"), claim(LEAF, tag="other")]
    )
    await g.guard.claim("order", Residue(2, 0))
    assert g.guard.refusal("order") is None
    assert [(c.tag, c.state) for c in g.announced] == [("order", "serving")]
    assert [c.tag for c in g.guard.claims()] == ["order"]


async def test_a_rival_refused_before_serving_is_no_rival(caplog: pytest.LogCaptureFixture) -> None:
    """A worker that refused at its first segment never handed out an ID: the serving worker warns, once."""
    g = Guard()
    await g.guard.claim("order", Residue(2, 0))
    turned_away = claim(Residue(2, 0), state="refused", issued=False)
    with caplog.at_level(logging.WARNING):
        await g.guard.heard([turned_away])
        await g.guard.heard([turned_away])
    assert g.guard.refusal("order") is None
    assert g.refused == []
    assert caplog.text.count("was refused tag 'order'") == 1
    await Guard(B, "newcomer").guard.heard([g.guard.claims()[0]])  # and it keeps its own verdict


async def test_two_serving_workers_that_meet_both_refuse() -> None:
    """Claims crossed in flight (or one was lost): on hearing a serving rival, a serving worker stops too."""
    g = Guard()
    await g.guard.claim("order", Residue(2, 0))
    await g.guard.heard([claim(Residue(2, 0))])
    ((tag, error),) = g.refused
    assert tag == "order"
    assert g.guard.refusal("order") is error
    assert [(c.state, c.issued) for c in g.announced] == [("serving", True), ("refused", True)]
    # A rival that served and then refused still counts: its IDs are out there.
    other = Guard(B, "peer")
    await other.guard.claim("order", Residue(2, 0))
    await other.guard.heard([g.announced[-1]])
    assert other.guard.refusal("order") is not None


async def test_a_recheck_forgets_peers_that_no_longer_answer() -> None:
    """A claim heard before a recheck and not in its answers is gone; one heard during the recheck stays."""
    g = Guard()
    await g.guard.heard([claim(Residue(2, 0), worker="gone")])
    round_ = g.guard.begin_round()
    await g.guard.heard([claim(Residue(2, 0), worker="announced-meanwhile", tag="t2")])
    await g.guard.end_round(round_, [claim(Residue(2, 1), worker="answered")])
    assert sorted(c.worker for c in g.guard.known()) == ["announced-meanwhile", "answered"]
    await g.guard.claim("order", Residue(2, 0))  # the gone worker's claim no longer refuses it
    assert g.guard.refusal("order") is None


async def test_a_released_tag_can_be_claimed_again() -> None:
    """A tag removed and re-added with a disjoint class is judged afresh."""
    g = Guard()
    await g.guard.heard([claim(Residue(2, 0))])
    with pytest.raises(ResidueOverlap):
        await g.guard.claim("order", Residue(2, 0))
    g.guard.release("order")
    assert g.guard.refusal("order") is None
    await g.guard.claim("order", Residue(2, 1))
    assert g.guard.refusal("order") is None


small = st.integers(1, 6).flatmap(lambda n: st.builds(Residue, st.just(n), st.integers(0, n - 1)))
some_claims = st.lists(
    st.builds(
        ResidueClaim,
        tag=st.sampled_from(["t", "u"]),
        database=st.sampled_from([A, B, Database("7003", "leaf")]),
        residue=small,
        worker=st.sampled_from(["w1", "w2", "w3", "w4"]),
        state=st.sampled_from(["serving", "refused"]),
        issued=st.booleans(),
    ),
    max_size=6,
)


@given(claims=some_claims)
def test_clashes_are_exactly_the_pairs_that_share_an_id(claims: list[ResidueClaim]) -> None:
    """``clashes`` names two databases for a tag iff two of their live claims on it share an ID (brute force)."""

    def shared(one: ResidueClaim, other: ResidueClaim) -> bool:
        return any(one.residue.owns(x) and other.residue.owns(x) for x in range(60))  # 60: lcm of 1..6

    expected = {
        (one.tag, frozenset((one.database, other.database)))
        for one in claims
        for other in claims
        if one.live
        and other.live
        and one.tag == other.tag
        and one.database != other.database
        and one.worker != other.worker
        and shared(one, other)
    }
    found = {(one.tag, frozenset((one.database, other.database))) for one, other in clashes(claims)}
    assert found == expected
