"""The guard against two live workers on one (datacenter, worker) ID: who refuses, on hearing whom."""

from __future__ import annotations

import logging

import pytest

from dispenser.core.errors import WorkerIdInUse
from dispenser.core.node_bits import node_bits
from dispenser.core.peers import Claim, ClaimState
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.service.identity import IdentityGuard

TWITTER = SnowflakeLayout(datacenter_bits=5, worker_bits=5)


def guard(
    datacenter_id: int = 1, worker_id: int = 0, layout: SnowflakeLayout = TWITTER
) -> tuple[IdentityGuard, list[WorkerIdInUse]]:
    refused: list[WorkerIdInUse] = []
    return IdentityGuard(
        datacenter_id, lambda: worker_id, "10.0.0.1:7", refused.append, layout=layout
    ), refused


def rival(state: ClaimState, datacenter_id: int = 1, worker_id: int = 0, nonce: str = "other") -> Claim:
    return Claim(datacenter_id, worker_id, nonce, state, "10.0.0.2:7")


@pytest.mark.parametrize("state", ["starting", "serving", ""])
def test_a_starting_worker_refuses_on_any_live_rival(
    state: ClaimState, caplog: pytest.LogCaptureFixture
) -> None:
    """Starting: a rival starting too (both refuse), serving, or an older worker that does not say."""
    me, refused = guard()
    with caplog.at_level(logging.ERROR, "dispenser.service.identity"):
        assert me.heard([rival(state)]) is not None
    me.started()
    assert me.state == "refused"
    assert [e.code for e in refused] == ["worker_id_in_use"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "worker ID 0 of datacenter 1" in line
    assert "10.0.0.2:7" in line
    assert "snowflake.datacenter_id" in line


def test_a_serving_worker_keeps_its_id_from_a_starting_rival() -> None:
    """The starting rival hears this worker's answer and refuses; this one keeps serving."""
    me, refused = guard()
    me.started()
    assert me.heard([rival("starting")]) is None
    assert me.heard([rival("starting")]) is None  # heard twice (its check and our recheck): one warning
    assert me.state == "serving"
    assert refused == []
    assert [c.nonce for c in me.turned_away] == ["other"]


def test_two_serving_workers_on_one_id_both_refuse() -> None:
    """Neither can prove the ID was its own first (IDs may have repeated already): both stop."""
    one, refused_one = guard()
    two, refused_two = guard()
    one.started()
    two.started()
    assert one.heard([two.claim()]) is not None
    assert two.heard([Claim(1, 0, one.nonce, "serving")]) is not None
    assert len(refused_one) == len(refused_two) == 1


def test_a_simultaneous_start_ends_with_at_most_one_server() -> None:
    """Both answer before they ask: whatever the order their checks are heard in, never two servers."""
    # Each worker hears the other's check (its answerer was up) and/or the other's answer to its own.
    for a_hears_b, b_hears_a in ((True, True), (True, False), (False, True)):
        a, _ = guard()
        b, _ = guard()
        if a_hears_b:
            a.heard([b.claim()])  # b's check reached a's answerer, or b answered a's check
        if b_hears_a:
            b.heard([a.claim()])
        a.started()
        b.started()
        assert [a.state, b.state].count("serving") <= 1, (a_hears_b, b_hears_a)


def test_others_are_no_rivals() -> None:
    """Another worker ID, another datacenter, this run's own claim, or a peer that already refused."""
    me, refused = guard()
    others = [
        rival("serving", worker_id=1),
        rival("serving", datacenter_id=2),
        Claim(1, 0, me.nonce, "serving"),
        rival("refused"),
    ]
    assert me.heard(others) is None
    me.started()
    assert me.state == "serving"
    assert refused == []


def test_a_refusal_is_for_the_rest_of_the_run() -> None:
    me, refused = guard()
    me.heard([rival("serving")])
    me.started()
    assert me.heard([]) is me.refusal
    assert me.claim().state == "refused"
    assert len(refused) == 1


def test_a_claim_on_another_layout_is_judged_by_its_node_bits() -> None:
    """Leaf's worker 32 and the 5 + 5 layout's datacenter 1, worker 0: other pairs, the same IDs."""
    me, refused = guard(1, 0)
    leaf_32 = Claim(0, 32, "leaf", "serving", "10.0.0.3:7", node_bits(SnowflakeLayout(), 0, 32))
    leaf_33 = Claim(0, 33, "leaf", "serving", "10.0.0.3:7", node_bits(SnowflakeLayout(), 0, 33))
    assert me.heard([leaf_33]) is None
    refusal = me.heard([leaf_32])
    assert refusal is not None
    assert "node bits 12-21 = 32" in str(refusal)
    assert "datacenter 0, worker 32" in str(refusal)
    assert len(refused) == 1


def test_a_claim_without_node_bits_is_compared_by_its_pair() -> None:
    """A worker older than the node bits says only its pair; it runs the fleet's layout, as it assumes."""
    me, refused = guard(1, 0)
    assert me.heard([Claim(0, 32, "old", "serving")]) is None
    assert me.heard([Claim(1, 0, "old", "serving")]) is not None
    assert me.claim().bits == node_bits(TWITTER, 1, 0)
    assert len(refused) == 1
