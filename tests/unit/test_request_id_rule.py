"""The request_id alphabet: 1 to 128 printable ASCII characters without space, checked where a request is decoded.

A request_id is a key in a store shared by every caller (PostgreSQL refuses NUL in text, so one NUL failed a
whole batch of other callers' answers; invalid UTF-8 in a URL became U+FFFD, so ``%ff``, ``%fe`` and ``%c0``
were one key): anything outside the alphabet is refused before it becomes a key, with ``invalid``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dispenser.core.errors import InvalidRequest
from dispenser.messages import (
    REQUEST_ID_MAX_LENGTH,
    decode_kafka_request,
    decode_request,
    query_request,
)

GOOD = ["r-1", "9b1f2c3d-0000-4000-8000-000000000000", "a" * 128, "!~{}[]\"'\\/+=:;@#$%^&*()<>?,.|`"]
BAD = [
    "a\x00b",  # PostgreSQL refuses NUL in text
    "\ufffd",  # what %ff, %fe and %c0 in a URL's query become
    "a b",  # space (and "+" in a URL's query)
    "tab\there",
    "line\n",  # Python's `$` matches before a final newline: the pattern must not let it through
    "\nline",
    "\x7f",
    "caf\u00e9",
    "\U0001f600",
    "a" * 129,
    "",
]


def allowed(request_id: str) -> bool:
    """The documented rule, written plainly (docs/protocol.md)."""
    return 1 <= len(request_id) <= REQUEST_ID_MAX_LENGTH and all("!" <= c <= "~" for c in request_id)


@pytest.mark.parametrize("request_id", GOOD)
def test_printable_ascii_request_ids_are_accepted_everywhere(request_id: str) -> None:
    """A UUID, 128 characters, every punctuation mark: accepted in JSON, msgpack, a Kafka body and a URL."""
    body = {"request_id": request_id}
    assert decode_request(msgspec.json.encode(body)).request_id == request_id
    assert decode_request(msgspec.msgpack.encode(body), msgpack=True).request_id == request_id
    assert decode_kafka_request(msgspec.json.encode(body)).request_id == request_id
    assert query_request(body).request_id == request_id


@pytest.mark.parametrize("request_id", BAD, ids=repr)
def test_other_request_ids_are_refused_as_invalid_and_not_retryable(request_id: str) -> None:
    """NUL, U+FFFD, space, control and non-ASCII characters, 129 characters, empty: ``invalid``, never retryable."""
    body = {"request_id": request_id}
    attempts: list[Callable[[], object]] = [
        lambda: decode_request(msgspec.json.encode(body)),
        lambda: decode_request(msgspec.msgpack.encode(body), msgpack=True),
        lambda: decode_kafka_request(msgspec.json.encode(body)),
        lambda: query_request(body),
    ]
    for attempt in attempts:
        with pytest.raises(InvalidRequest) as refused:
            attempt()
        assert (refused.value.code, refused.value.retryable) == ("invalid", False)
        assert "request_id" in refused.value.message


def test_the_refusal_says_what_is_accepted() -> None:
    """The message names the rule (not a regular expression) and the field."""
    with pytest.raises(InvalidRequest) as refused:
        decode_request(b'{"request_id": "a\\u0000b"}')
    message = refused.value.message
    assert "1 to 128" in message
    assert "printable ASCII" in message
    assert "$.request_id" in message


@given(st.text(max_size=140))
@example("abc\n")
@example("a\x00b")
@example("\ufffd")
def test_a_request_id_decodes_exactly_when_the_documented_rule_allows_it(request_id: str) -> None:
    """For any string: JSON decode accepts it as a request_id iff it is 1-128 characters of ``!``..``~``."""
    body = msgspec.json.encode({"request_id": request_id})
    try:
        decoded = decode_request(body)
    except InvalidRequest:
        assert not allowed(request_id)
    else:
        assert allowed(request_id)
        assert decoded.request_id == request_id
