"""The media type of an ID answer, chosen from the caller's ``Accept`` as Leaf's server chooses it.

Leaf's controllers return a ``String``; Spring MVC 4.3 (Spring Boot 1.5) then picks the answer's media type
from the request's ``Accept`` among what its converters can write for a string: ``text/plain`` and ``*/*``
(the string converter) and ``application/json``, ``application/*+json`` (Jackson, on Leaf's class path).
Every requested type is compatible with ``*/*``, so a caller gets the first concrete type it asks for, by
quality, then specificity: ``application/json`` for Spring's ``RestTemplate`` asked for a ``Long`` (which
otherwise finds no converter for ``text/plain`` and throws), ``text/html`` for a browser, ``text/plain`` for
curl. The body is the decimal digits whatever the type, as Leaf's is. The captured answers of Leaf itself
are in ``tests/integration/leaf_answers.json``; the differences we keep are in ``docs/http.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["id_media_type", "prefers_html"]

_PRODUCIBLE = (("text", "plain"), ("*", "*"), ("application", "json"), ("application", "*+json"))
"""What Leaf's converters write a string as, in their order."""
_LIMIT = 256
"""Distinct ``Accept`` values remembered (callers send few; a hostile one cannot grow the cache)."""


@dataclass(frozen=True, slots=True)
class _Type:
    type: str
    subtype: str
    quality: float
    parameters: int
    """Parameters other than ``q`` (more is more specific)."""

    @property
    def concrete(self) -> bool:
        return self.type != "*" and "*" not in self.subtype

    def name(self) -> str:
        return f"{self.type}/{self.subtype}"


def _parse(accept: str) -> list[_Type] | None:
    """The media ranges of an ``Accept`` value, in order; None when one is malformed."""
    ranges: list[_Type] = []
    for item in accept.split(","):
        if not item.strip():
            continue
        mime, *parameters = (part.strip() for part in item.split(";"))
        kind, slash, subtype = mime.lower().partition("/")
        if not slash or not kind or not subtype or (kind == "*" and subtype != "*"):
            return None
        quality, others = 1.0, 0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() != "q":
                others += 1
                continue
            try:
                quality = float(value)
            except ValueError:
                return None
            if not 0.0 <= quality <= 1.0:
                return None
        ranges.append(_Type(kind, subtype, quality, others))
    return ranges


def _compatible(a: _Type, kind: str, subtype: str) -> bool:
    if a.type == "*" or kind == "*":
        return True
    if a.type != kind:
        return False
    if a.subtype in (subtype, "*") or subtype == "*":
        return True
    # Wildcards in a suffix (application/*+json) match application/json and application/vnd.x+json.
    for pattern, other in ((a.subtype, subtype), (subtype, a.subtype)):
        if pattern.startswith("*+"):
            suffix = pattern[2:]
            if other == suffix or other.endswith("+" + suffix):
                return True
    return False


def _specificity(a: _Type, b: _Type) -> int:
    """Negative when ``a`` sorts first (more specific, or of a higher quality where neither is)."""
    if a.type == "*" and b.type != "*":
        return 1
    if b.type == "*" and a.type != "*":
        return -1
    if a.type != b.type:
        return 0
    a_wild, b_wild = a.subtype.startswith("*"), b.subtype.startswith("*")
    if a_wild and not b_wild:
        return 1
    if b_wild and not a_wild:
        return -1
    if a.subtype != b.subtype:
        return 0
    if a.quality != b.quality:
        return -1 if a.quality > b.quality else 1
    return b.parameters - a.parameters


def _quality_order(a: _Type, b: _Type) -> int:
    if a.quality != b.quality:
        return -1 if a.quality > b.quality else 1
    return 0


@functools.lru_cache(maxsize=_LIMIT)
def id_media_type(accept: str | None) -> str | None:
    """The media type of an ID answer for this ``Accept`` (None or empty: none sent); None: 406.

    Spring's ``AbstractMessageConverterMethodProcessor.writeWithMessageConverters``: each requested range
    against each type the converters produce, the more specific of the two (with the requested quality);
    sorted by specificity, then quality; the first concrete one, or ``application/octet-stream`` for
    ``*/*`` or ``application/*`` alone. An ``Accept`` that does not parse is refused (406), as Spring does.
    """
    requested = [_Type("*", "*", 1.0, 0)] if not accept or not accept.strip() else _parse(accept)
    if not requested:
        return None
    found: list[_Type] = []
    for wanted in requested:
        for kind, subtype in _PRODUCIBLE:
            if not _compatible(wanted, kind, subtype):
                continue
            produced = _Type(kind, subtype, wanted.quality, 0)
            chosen = wanted if _specificity(wanted, produced) <= 0 else produced
            if chosen not in found:
                found.append(chosen)
    found.sort(key=functools.cmp_to_key(lambda a, b: _specificity(a, b) or _quality_order(a, b)))
    for candidate in found:
        if candidate.concrete:
            return candidate.name()
        if (candidate.type, candidate.subtype) in (("*", "*"), ("application", "*")):
            return "application/octet-stream"
    return None


@functools.lru_cache(maxsize=_LIMIT)
def prefers_html(accept: str | None) -> bool:
    """Whether an error page should be HTML, as Spring Boot's error controller answers a browser.

    True when ``text/html`` is asked for explicitly and nothing is asked for with a higher quality.
    """
    ranges = _parse(accept) if accept else None
    if not ranges:
        return False
    html = [r.quality for r in ranges if (r.type, r.subtype) == ("text", "html") and r.quality > 0]
    return bool(html) and max(html) >= max(r.quality for r in ranges)
