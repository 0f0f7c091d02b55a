"""The decisions of ``dispenser enrich``: which records take an ID, and where it goes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.service.enrichment import Enriched, Placement, Rejection, transformer

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
objects = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


def enrich(placement: Placement, value: bytes | None, id_: int = 42, **record: Any) -> Any:
    transform = transformer(placement, 1_000_000)
    return transform(record.get("key", b"k"), value, list(record.get("headers", [("h", b"1")])), id_)


def test_default_placement_is_the_field_id() -> None:
    """With no option, the ID goes into the top-level field ``id``."""
    assert Placement.from_options() == Placement("field", path=("id",))


def test_only_one_placement_may_be_given() -> None:
    """--field, --header and --key exclude each other; empty names are refused."""
    with pytest.raises(ValueError, match="only one"):
        Placement.from_options(field="id", key=True)
    with pytest.raises(ValueError, match="dotted path"):
        Placement.from_options(field="order..id")
    with pytest.raises(ValueError, match="header name"):
        Placement.from_options(header="")


@given(objects, st.integers(0, 2**63 - 1))
def test_a_top_level_field_gets_the_id_and_the_rest_is_kept(document: dict[str, Any], id_: int) -> None:
    """Any JSON object takes the ID in its field; every other field keeps its value and order."""
    out = enrich(Placement.from_options(field="id"), json.dumps(document).encode(), id_)
    decoded = json.loads(out.value)
    assert decoded.pop("id") == id_
    document.pop("id", None)
    assert decoded == document
    assert out.key == b"k"
    assert out.headers == [("h", b"1")]


def test_a_nested_field_path_is_followed() -> None:
    """``order.id`` sets the field inside the ``order`` object."""
    out = enrich(Placement.from_options(field="order.id"), b'{"order": {"sku": "a"}, "n": 1}', 7)
    assert json.loads(out.value) == {"order": {"sku": "a", "id": 7}, "n": 1}


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (b"not json", "not_json"),
        (b"[1, 2]", "not_an_object"),
        (b'{"order": 3}', "not_an_object"),
        (b'{"other": {}}', "field_missing"),
        (None, "no_value"),
        (b"\xff\xfe", "not_json"),
    ],
)
def test_records_that_cannot_take_a_field_are_rejected_with_a_code(value: bytes | None, code: str) -> None:
    """Not JSON, not an object, a missing parent, a tombstone: each is a rejection naming why."""
    result = enrich(Placement.from_options(field="order.id"), value)
    assert isinstance(result, Rejection)
    assert result.code == code
    assert result.message


def test_a_record_over_the_size_limit_is_rejected_whatever_the_placement() -> None:
    """The size limit holds for header and key placement too."""
    for placement in (
        Placement.from_options(),
        Placement.from_options(header="x"),
        Placement.from_options(key=True),
    ):
        result = transformer(placement, 1_000)(b"k", b"{}" + b" " * 2000, [], 1)
        assert isinstance(result, Rejection)
        assert result.code == "too_large"


@given(st.binary(max_size=64), st.integers(0, 2**63 - 1))
def test_header_placement_leaves_key_and_value_alone(value: bytes, id_: int) -> None:
    """``--header leaf-id``: any value (JSON or not) passes unchanged; the header holds the ID in decimal."""
    out = enrich(
        Placement.from_options(header="leaf-id"), value, id_, headers=[("a", b"1"), ("leaf-id", b"old")]
    )
    assert (out.key, out.value) == (b"k", value)
    assert out.headers == [("a", b"1"), ("leaf-id", str(id_).encode())]


def test_a_nested_path_through_a_non_object_is_rejected_with_its_name() -> None:
    """The message names the part of the path that is not an object."""
    result = enrich(Placement.from_options(field="a.b.id"), b'{"a": {"b": [1]}}')
    assert isinstance(result, Rejection)
    assert (result.code, result.message) == ("not_an_object", "a.b is not a JSON object")
    done = enrich(Placement.from_options(field="a.b.id"), b'{"a": {"b": {}}}', 5)
    assert isinstance(done, Enriched)
    assert json.loads(done.value or b"") == {"a": {"b": {"id": 5}}}


def test_key_placement_replaces_the_key_only() -> None:
    """``--key``: the key becomes the ID; value and headers pass unchanged."""
    out = enrich(Placement.from_options(key=True), b"payload", 99)
    assert (out.key, out.value, out.headers) == (b"99", b"payload", [("h", b"1")])
