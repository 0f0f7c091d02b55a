"""Where an ID goes in a record, and which records cannot take one: the decisions of ``dispenser enrich``.

No Kafka here: a record is ``(key, value, headers)``. :func:`transformer` builds, once per stream, the
function that puts an ID into a record (a JSON ``field``, a ``header`` or the ``key``), or answers a
:class:`Rejection` with a stable code for the dead-letter topic. The placements and why a rejected
record's ID is skipped: ``docs/kafka.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

__all__ = ["Enriched", "Placement", "Rejection", "RejectionCode", "Transform", "transformer"]

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


RejectionCode = Literal["not_json", "not_an_object", "field_missing", "no_value", "too_large"]
"""The codes a dead letter's ``leaf-error-code`` header may carry."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a record cannot be enriched (its dead-letter headers carry code and message)."""

    code: RejectionCode
    message: str


@dataclass(frozen=True, slots=True)
class Enriched:
    """A record with its ID in place."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


Transform = Callable[[bytes | None, bytes | None, list[tuple[str, bytes]], int], "Enriched | Rejection"]
"""``transform(key, value, headers, id_)``: the record with its ID in place, or why it cannot take one.
``headers`` is the caller's fresh list, which the transform may change and return."""


def transformer(placement: Placement, max_bytes: int) -> Transform:
    """The per-record function for ``placement``, specialised once: it runs for every record of a stream.

    Records over ``max_bytes`` are rejected whatever the placement; for ``field``, so are values that
    are not JSON, not an object, or lack a parent object on the path.
    """
    if placement.where == "field":
        return _field_transform(placement.path, max_bytes)
    if placement.where == "header":
        name = placement.header

        def put_header(
            key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], id_: int
        ) -> Enriched | Rejection:
            if value is not None and len(value) > max_bytes:
                return _too_large(len(value), max_bytes)
            kept = [(k, v) for k, v in headers if k != name] if headers else headers
            kept.append((name, str(id_).encode()))
            return Enriched(key, value, kept)

        return put_header

    def put_key(
        _key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], id_: int
    ) -> Enriched | Rejection:
        if value is not None and len(value) > max_bytes:
            return _too_large(len(value), max_bytes)
        return Enriched(str(id_).encode(), value, headers)

    return put_key


def _too_large(size: int, limit: int) -> Rejection:
    return Rejection("too_large", f"record value of {size} bytes is over the limit of {limit} bytes")


_NO_VALUE = Rejection("no_value", "the record has no value (a tombstone); nowhere to put a field")
_NOT_AN_OBJECT = Rejection("not_an_object", "the value is not a JSON object")


def _field_transform(path: tuple[str, ...], max_bytes: int) -> Transform:
    *parents, last = path
    decode, encode = _decode.decode, _encode.encode

    def put_field(
        key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], id_: int
    ) -> Enriched | Rejection:
        if value is None:
            return _NO_VALUE
        if len(value) > max_bytes:
            return _too_large(len(value), max_bytes)
        try:
            document = decode(value)
        except msgspec.DecodeError as exc:
            return Rejection("not_json", f"record value is not JSON: {exc}")
        if type(document) is not dict:
            return _NOT_AN_OBJECT
        target = document
        for depth, name in enumerate(parents):
            if name not in target:
                return Rejection("field_missing", f"field {'.'.join(path[: depth + 1])} is missing")
            target = target[name]
            if type(target) is not dict:
                return Rejection("not_an_object", f"{'.'.join(path[: depth + 1])} is not a JSON object")
        target[last] = id_
        return Enriched(key, encode(document), headers)

    return put_field
