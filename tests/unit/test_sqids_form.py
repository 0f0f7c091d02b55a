"""The sqids reply format (core/sqids_form.py): each ID's string decodes back to it; other strings are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dispenser.cli import main
from dispenser.core.errors import BadRequest
from dispenser.core.permute import MAX_EPOCH, SPAN, Permutation
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.core.sqids_form import ALPHABET, MAX_SQID_ID, MIN_LENGTH, from_sqid, sqids_of, to_sqid
from tests.secret_values import SECRETS

PERMUTED = st.integers(SPAN, (MAX_EPOCH + 1) * SPAN - 1)
"""Every permuted ID: ``[10**18, 9 * 10**18)``."""


@given(PERMUTED)
@example(SPAN)
@example(SPAN + 1)
@example(2 * SPAN - 1)
@example(2 * SPAN)
@example((MAX_EPOCH + 1) * SPAN - 2)
@example((MAX_EPOCH + 1) * SPAN - 1)
def test_a_permuted_ids_string_decodes_back_to_it(value: int) -> None:
    """Round trip over the permuted IDs, edges and random values: 12 characters of the alphabet."""
    text = to_sqid(value)
    assert from_sqid(text) == value
    assert len(text) == MIN_LENGTH
    assert set(text) <= set(ALPHABET)


@given(st.integers(0, MAX_SQID_ID))
@example(0)
@example(1)
@example(MAX_SQID_ID)
def test_any_64_bit_id_round_trips_in_12_characters(value: int) -> None:
    """A plain tag may ask for the form too: any ID 0 to 2**63 - 1, the same length."""
    text = to_sqid(value)
    assert (from_sqid(text), len(text)) == (value, MIN_LENGTH)


@given(st.lists(PERMUTED, min_size=2, max_size=50, unique=True))
def test_distinct_ids_give_distinct_strings(values: list[int]) -> None:
    """The form keeps IDs unique: no two IDs of a reply share a string."""
    strings = sqids_of([(v, v) for v in values])
    assert len(set(strings)) == len(values)
    assert [from_sqid(s) for s in strings] == values


def test_the_strings_are_pinned() -> None:
    """A sqids release that made other strings of the same numbers would fail here (pyproject: <0.6)."""
    assert to_sqid(SPAN) == "p5drq7BwsFlD"
    assert to_sqid((MAX_EPOCH + 1) * SPAN - 1) == "ny99jEGRKl60"
    assert to_sqid(1) == "UkLWZg9DAJQ7"
    assert sqids_of([(1, 2)]) == [to_sqid(1), to_sqid(2)]


@pytest.mark.parametrize(
    "text",
    ["", "a", "abc", "!!!!!!!!!!!!", "é" * 12, "p5drq7BwsFl", "p5drq7BwsFlDx", to_sqid(SPAN)[::-1]],
)
def test_no_ids_string_is_refused(text: str) -> None:
    """Too short, too long, outside the alphabet, or not the canonical string of its number."""
    with pytest.raises(BadRequest, match="no ID in the sqids form"):
        from_sqid(text)


def test_decode_tag_gives_the_same_epoch_and_counter_for_the_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser decode --tag order <string>` prints what the integer gives, and the integer itself."""
    (tmp_path / "order.keys").write_text(f"1 {SECRETS['permute_key']}\n")
    monkeypatch.setenv("DISPENSER_SEGMENT_PERMUTE_KEYS_DIR", str(tmp_path))
    permuted_id = Permutation("order", {1: bytes.fromhex(SECRETS["permute_key"])}).encode(17)
    assert main(["decode", "--tag", "order", str(permuted_id)]) == 0
    as_number = capsys.readouterr().out
    assert main(["decode", "--tag", "order", to_sqid(permuted_id)]) == 0
    assert capsys.readouterr().out == as_number
    assert "counter:   17\n" in as_number
    assert main(["decode", "--tag", "order", "p5drq7BwsFlx"]) == 1
    assert "no ID in the sqids form" in capsys.readouterr().err
    assert main(["decode", "--tag", "order", "1_000"]) == 1  # neither decimal digits nor a string
    assert "no ID in the sqids form" in capsys.readouterr().err


def test_decode_takes_a_snowflake_ids_string(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --tag: a snowflake ID's string decodes as its number does."""
    snowflake_id = SnowflakeLayout().compose(1_795_251_696_389, 7, 42)
    assert main(["decode", str(snowflake_id)]) == 0
    as_number = capsys.readouterr().out
    assert main(["decode", to_sqid(snowflake_id)]) == 0
    assert capsys.readouterr().out == as_number
