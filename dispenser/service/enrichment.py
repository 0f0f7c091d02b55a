"""Where an ID goes in a record, and which records cannot take one: the decisions of ``dispenser enrich``.

No Kafka here: a record is ``(key, value, headers)``. :func:`inspect` decides first whether a record can be
enriched at all (so that the caller knows how many IDs to take) and :func:`place` then puts one ID in.
A record that cannot be enriched gets a :class:`Rejection` with a stable code; the caller sends it to the
dead-letter topic instead of stopping the stream.

Placements:
    ``field``: a JSON object field, by dotted path (``id``, ``order.id``). The value must be a JSON object
    and every parent on the path must exist and be an object; the last name is set (replaced if present).
    The value is re-encoded (msgspec): keys keep their order, numbers their value.
    ``header``: a header (e.g. ``leaf-id``) holding the ID in ASCII decimal; the value is untouched.
    ``key``: the record key becomes the ID in ASCII decimal; the value is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = ["Enriched", "Placement", "Rejection", "inspect", "place"]

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the ID goes: a JSON field path, a header, or the key."""

    where: Literal["field", "header", "key"]
    path: tuple[str, ...] = ()
    header: str = ""

    @classmethod
    def from_options(
        cls, field: str | None = None, header: str | None = None, key: bool = False
    ) -> Placement:
        """Build from the CLI's ``--field`` / ``--header`` / ``--key`` (exactly one; ``--field id`` if none).

        Raises:
            ValueError: more than one was given, or a name is empty.
        """
        given = sum(x is not None and x is not False for x in (field, header, key))
        if given > 1:
            raise ValueError("give only one of --field, --header and --key")
        if header is not None:
            if not header:
                raise ValueError("--header needs a header name")
            return cls("header", header=header)
        if key:
            return cls("key")
        path = tuple((field or "id").split("."))
        if any(not part for part in path):
            raise ValueError(f"--field {field!r} is not a dotted path of field names")
        return cls("field", path=path)

    def describe(self) -> str:
        """How the CLI spells this placement."""
        if self.where == "field":
            return f"field {'.'.join(self.path)}"
        if self.where == "header":
            return f"header {self.header}"
        return "key"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a record cannot be enriched (its dead-letter headers carry code and message)."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Enriched:
    """A record with its ID in place."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def inspect(placement: Placement, value: bytes | None, max_bytes: int) -> Rejection | Any:
    """Whether a record's value can take an ID: a :class:`Rejection`, or what :func:`place` needs.

    Returns:
        A :class:`Rejection`; else, for ``field``, the decoded JSON object, and ``None`` otherwise.
    """
    size = len(value) if value is not None else 0
    if size > max_bytes:
        return Rejection("too_large", f"record value of {size} bytes is over the limit of {max_bytes} bytes")
    if placement.where != "field":
        return None
    if value is None:
        return Rejection("no_value", "the record has no value (a tombstone); nowhere to put a field")
    try:
        document = _decode.decode(value)
    except msgspec.DecodeError as exc:
        return Rejection("not_json", f"record value is not JSON: {exc}")
    target = document
    for depth, name in enumerate(placement.path[:-1]):
        where = ".".join(placement.path[:depth]) or "the value"
        if not isinstance(target, dict):
            return Rejection("not_an_object", f"{where} is not a JSON object")
        if name not in target:
            missing = ".".join(placement.path[: depth + 1])
            return Rejection("field_missing", f"field {missing} is missing")
        target = target[name]
    if not isinstance(target, dict):
        where = ".".join(placement.path[:-1]) or "the value"
        return Rejection("not_an_object", f"{where} is not a JSON object")
    return document


def place(
    placement: Placement,
    inspected: Any,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]],
    id_: int,
) -> Enriched:
    """Put ``id_`` into a record that :func:`inspect` accepted (``inspected`` is what it returned)."""
    if placement.where == "field":
        target = inspected
        for name in placement.path[:-1]:
            target = target[name]
        target[placement.path[-1]] = id_
        return Enriched(key, _encode.encode(inspected), list(headers))
    text = str(id_).encode()
    if placement.where == "header":
        kept = [(k, v) for k, v in headers if k != placement.header]
        return Enriched(key, value, [*kept, (placement.header, text)])
    return Enriched(text, value, list(headers))
