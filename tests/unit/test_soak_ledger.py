"""The soak's reply checks and ID ledger: malformed replies are caught, duplicates are counted exactly."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser_lab.soak.ledger import RangeSet, check_reply, runs_of
from dispenser_lab.soak.plan import (
    PROFILES,
    ClockStep,
    KillLeader,
    KillWorker,
    LoseDatacenter,
    Rejoin,
    RestartServer,
    RestoreDatacenter,
    StartServer,
    StopServer,
    scaled,
)
from dispenser_lab.soak.report import clock_step_seen


def encode(reply: dict[str, object]) -> bytes:
    return msgspec.json.encode(reply)


def test_runs_of_collapses_consecutive_ids() -> None:
    """Consecutive IDs become one run; gaps start a new one."""
    assert runs_of([5, 6, 7, 10, 11, 20]) == [(5, 7), (10, 11), (20, 20)]
    assert runs_of([1, 2, 3]) == [(1, 3)]
    assert runs_of([]) == []


def test_runs_of_refuses_unordered_ids() -> None:
    """IDs that repeat or go down within one reply are an error."""
    with pytest.raises(ValueError, match="not strictly increasing"):
        runs_of([1, 3, 2, 4])
    with pytest.raises(ValueError, match="not strictly increasing"):
        runs_of([1, 2, 2])


def test_good_ids_and_ranges_replies_pass() -> None:
    """A reply with the count asked for, in the format asked for, is good."""
    ids = check_reply(encode({"tag": "t", "ids": [1, 2, 3, 9]}), None, tag="t", count=4, fmt="ids")
    assert ids.outcome == "ids"
    assert ids.runs == ((1, 3), (9, 9))
    ranges = check_reply(
        encode({"tag": "t", "ranges": [[1, 10], [21, 30]]}), None, tag="t", count=20, fmt="ranges"
    )
    assert ranges.outcome == "ids"
    assert ranges.runs == ((1, 10), (21, 30))


@pytest.mark.parametrize(
    ("body", "fmt", "count", "reason"),
    [
        (b"not json", "ids", 1, "undecodable"),
        (encode({"tag": "other", "ids": [1]}), "ids", 1, "tag"),
        (encode({"tag": "t", "ids": [1, 2]}), "ids", 3, "2 IDs instead of 3"),
        (encode({"tag": "t", "ranges": [[1, 2]]}), "ids", 2, "asked for ids"),
        (encode({"tag": "t", "ranges": [[5, 4]]}), "ranges", 2, "bad range"),
        (encode({"tag": "t", "ranges": [[1, 5], [5, 6]]}), "ranges", 7, "overlapping"),
        (encode({"tag": "t", "ranges": [[0, 1]]}), "ranges", 2, "bad range"),
        (encode({"tag": "t", "ids": [3, 2]}), "ids", 2, "not strictly increasing"),
    ],
)
def test_malformed_replies_are_caught(body: bytes, fmt: str, count: int, reason: str) -> None:
    """Undecodable, wrong tag, wrong count, wrong format, bad or overlapping ranges: all malformed."""
    checked = check_reply(body, None, tag="t", count=count, fmt="ids" if fmt == "ids" else "ranges")
    assert checked.outcome == "malformed"
    assert reason in checked.reason


def test_error_replies_report_code_retryable_and_missing_header() -> None:
    """An error reply is an error; a missing code or status header is named as its problem."""
    body = encode({"tag": "t", "error": {"code": "unavailable", "message": "m", "retryable": True}})
    good = check_reply(body, {"Nats-Service-Error-Code": "503"}, tag="t", count=1, fmt="ids")
    assert (good.outcome, good.code, good.retryable, good.reason) == ("error", "unavailable", True, "")
    bare = check_reply(body, None, tag="t", count=1, fmt="ids")
    assert bare.reason == "no Nats-Service-Error-Code header"
    uncoded = encode({"tag": "t", "error": {"code": "", "message": "m", "retryable": True}})
    assert (
        "no error code"
        in check_reply(uncoded, {"Nats-Service-Error-Code": "500"}, tag="t", count=1, fmt="ids").reason
    )


def test_overlaps_counts_duplicate_ids() -> None:
    """Runs that overlap count the IDs they share; touching runs don't."""
    ranges = RangeSet()
    ranges.add([(1, 10), (11, 20), (15, 16), (30, 40), (40, 40)])
    found = ranges.overlaps()
    assert found.ids == 3
    assert ((11, 20), (15, 16)) in found.examples
    assert ranges.ids == 34


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 20)), max_size=60))
def test_overlaps_agrees_with_counting_one_by_one(spans: list[tuple[int, int]]) -> None:
    """The sorted sweep finds exactly as many repeats as a multiset of the IDs would."""
    ranges = RangeSet()
    ranges.add((first, first + length) for first, length in spans)
    every = [i for first, length in spans for i in range(first, first + length + 1)]
    assert ranges.overlaps().ids == len(every) - len(set(every))


def test_profiles_inject_every_fault() -> None:
    """Every profile kills a worker and steps the clock, and injects its topology's server faults.

    The single-stack ones stop and start PostgreSQL and ZooKeeper and restart NATS; the clustered ones kill
    each cluster's leader and let it rejoin. The two-datacenter one loses dc-a's workers, killed and
    frozen, twice restored.
    """
    for profile in PROFILES.values():
        faults = [phase.fault for phase in profile.phases if phase.fault is not None]
        if profile.topology == "dc":
            assert LoseDatacenter() in faults
            assert LoseDatacenter(freeze=True) in faults
            assert faults.count(RestoreDatacenter()) == 2
            continue
        assert any(isinstance(f, KillWorker) for f in faults)
        if profile.topology == "ha":
            for cluster in ("postgres", "nats", "zookeeper", "kafka"):
                assert KillLeader(cluster) in faults, (profile.name, cluster)
                assert Rejoin(cluster) in faults, (profile.name, cluster)
        else:
            for server in ("postgres", "zookeeper"):
                assert StopServer(server) in faults or StopServer(server, kill=True) in faults
                assert StartServer(server) in faults
            assert any(isinstance(f, RestartServer) and f.server == "nats" for f in faults)
        assert ClockStep(1000) in faults
        assert ClockStep(-10) in faults
        assert profile.phases[-1].must_be_clean
        assert len({phase.name for phase in profile.phases}) == len(profile.phases)
    assert PROFILES["short"].planned_s <= 90
    assert PROFILES["short"].min_ids >= 10_000_000


def test_scaled_profile_shrinks_durations_and_target() -> None:
    """--scale multiplies phase durations and the ID target."""
    small = scaled(PROFILES["short"], 0.5)
    assert small.planned_s == pytest.approx(PROFILES["short"].planned_s / 2, abs=1)
    assert small.min_ids == PROFILES["short"].min_ids // 2


def test_clock_step_is_judged_against_the_other_workers() -> None:
    """A stepped clock counts when it is off by the offset relative to the unstepped workers."""
    assert clock_step_seen(1000, [-60, -60, 940])
    assert clock_step_seen(990, [2, 4, 988])
    assert not clock_step_seen(1000, [0, 1, 3])
    assert not clock_step_seen(1000, [])
