"""The import's decisions (dispenser.core.leaf_import) and the MySQL DSN it takes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.adapters.mysql.leaf import MySQLTarget, parse_mysql_dsn
from dispenser.core.leaf_import import LEAF_MAX_STEP, Action, LeafRow, default_margin, plan_import
from dispenser.core.store_rules import MAX_ID, MAX_STEP
from dispenser.leaf_import import ImportReport

tags = st.sampled_from(["order", "user", "pay.v2", "a-b_c"])
rows = st.builds(
    LeafRow,
    tag=tags,
    max_id=st.integers(1, 2**62),
    step=st.integers(1, MAX_STEP),
)


def test_the_default_margin_is_one_largest_leaf_segment() -> None:
    assert LEAF_MAX_STEP == 1_000_000  # SegmentIDGenImpl.MAX_STEP
    assert default_margin(1000) == 1_000_000
    assert default_margin(5_000_000) == 5_000_000  # Leaf never doubles past MAX_STEP, nor below its step


@given(
    row=rows,
    current=st.none() | st.integers(1, MAX_ID),
    margin=st.none() | st.integers(0, 10**7),
    force=st.booleans(),
)
def test_a_tag_starts_above_leaf_and_is_never_lowered(
    row: LeafRow, current: int | None, margin: int | None, force: bool
) -> None:
    existing = {} if current is None else {row.tag: current}
    [plan] = plan_import([row], existing, margin=margin, force=force)
    expected_start = row.max_id + (default_margin(row.step) if margin is None else margin)
    assert plan.start == expected_start
    assert plan.start > row.max_id - 1  # above Leaf's highest possible ID
    if current is None:
        assert plan.action is Action.CREATE
    elif current >= plan.start:
        assert plan.action is Action.UNCHANGED
    else:
        assert plan.action is (Action.RAISE if force else Action.REFUSED)
    assert plan.failed == (plan.action is Action.REFUSED)


@given(row=rows, margin=st.none() | st.integers(0, 10**7))
def test_planning_again_after_applying_changes_nothing(row: LeafRow, margin: int | None) -> None:
    [first] = plan_import([row], {}, margin=margin)
    [again] = plan_import([row], {row.tag: first.start}, margin=margin)
    assert again.action is Action.UNCHANGED


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (LeafRow("bad tag", 1, 10), "not a valid dispenser tag name"),
        (LeafRow("x" * 129, 1, 10), "not a valid dispenser tag name"),
        (LeafRow("order", 1, 0), "step 0 is outside"),
        (LeafRow("order", 0, 10), "max_id 0 is below 1"),
        (LeafRow("order", MAX_ID - 5, 10), "passes the largest ID"),
    ],
)
def test_rows_the_dispenser_cannot_take_are_invalid(row: LeafRow, reason: str) -> None:
    [plan] = plan_import([row], {})
    assert plan.action is Action.INVALID
    assert reason in plan.reason
    assert plan.failed


def test_a_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        plan_import([], {}, margin=-1)


def test_the_report_says_what_would_be_done() -> None:
    plans = plan_import(
        [LeafRow("a", 10, 5), LeafRow("b", 10, 5), LeafRow("c", 10, 5)], {"b": 100, "c": 12}, margin=5
    )
    lines = ImportReport(plans, dry_run=True).lines()
    assert lines == [
        "would create  a: first ID 15, step 5 (Leaf max_id 10, step 5)",
        "unchanged b: next ID 100 >= 15 (Leaf max_id 10, step 5)",
        "REFUSED c: next ID 12 < 15: the dispenser's tag is below the safe start (Leaf granted more since?); "
        "--force raises it",
        "dry run, nothing written: 3 tag(s): 1 create, 1 unchanged, 1 refused",
    ]


def test_mysql_dsns() -> None:
    assert parse_mysql_dsn("mysql://leaf:p%40ss@db.example:3307/leaf?ssl_ca=/etc/ca.pem") == MySQLTarget(
        "db.example", 3307, "leaf", "p@ss", "leaf", "/etc/ca.pem"
    )
    assert parse_mysql_dsn("mariadb://127.0.0.1/leaf") == MySQLTarget("127.0.0.1", 3306, "root", "", "leaf")
    for bad, message in [
        ("postgresql://u:pw@h/leaf", "not a MySQL DSN"),
        ("mysql://u:pw@h:3306", "names no database"),
        ("mysql://u:pw@h:port/leaf", "port is not a number"),
        ("mysql://u:pw@h/leaf?sslmode=require", "unknown MySQL DSN parameter(s) sslmode"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            parse_mysql_dsn(bad)
        assert ":pw@" not in str(info.value)  # the password is masked
