"""The ``sqids`` reply format: each ID as a short string, by the ``sqids`` package (sqids.org, Sqids' spec).

The default Sqids alphabet (62 letters and digits) and blocklist, and a minimum length of :data:`MIN_LENGTH`:
every ID, ``0`` to ``2**63 - 1``, is exactly 12 characters (docs/permuted.md, "The string form"). It is an
encoding, not a cipher: anyone with the package reads the number back, so a plain tag's string shows its
counter as plainly as the number does.

Distinct IDs give distinct strings (decoding undoes encoding, whatever blocklist minted the string), so the
form keeps every ID unique. :func:`from_sqid` takes only the string this release makes of a number (a typo
almost always turns the string into another number's non-canonical form, and is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqids import Sqids
from sqids.constants import DEFAULT_ALPHABET

from dispenser.core.errors import BadRequest

__all__ = [
    "ALPHABET",
    "MAX_SQIDS",
    "MAX_SQID_ID",
    "MIN_LENGTH",
    "from_sqid",
    "sqids_of",
    "to_sqid",
]

ALPHABET = DEFAULT_ALPHABET
"""Sqids' default alphabet, the same for every tag: the string hides nothing the number does not (the
permutation is what hides), so a per-tag alphabet would add a setting and no secret."""

MIN_LENGTH = 12
"""Every string is at least this long: the length of the largest 64-bit ID's (a prefix and 11 base-61 digits),
so every string is exactly 12 characters and its length tells nothing about the number."""

MAX_SQIDS = 1000
"""The most IDs one request gets in the sqids format (or ``limits.max_ids`` if lower): each string costs ~11 µs
in the worker's event loop (the package's blocklist check is ~8 of them), so 1,000 hold the worker's other
requests ~11 ms at most (docs/permuted.md, "The string form")."""

MAX_SQID_ID = 2**63 - 1
"""The largest ID a string may stand for: IDs are positive 64-bit signed integers."""

_SQIDS = Sqids(min_length=MIN_LENGTH)  # the default alphabet and blocklist (sqids 0.5.x)


def to_sqid(value: int) -> str:
    """The string of one ID (``0 <= value <= 2**63 - 1``)."""
    return _SQIDS.encode((value,))


def sqids_of(ranges: Iterable[Sequence[int]]) -> list[str]:
    """The strings of every ID of ``ranges`` (inclusive ``(first, last)`` pairs), in order."""
    encode = _SQIDS.encode
    return [encode((i,)) for first, last in ranges for i in range(first, last + 1)]


def from_sqid(text: str) -> int:
    """The ID whose string is ``text``.

    Raises:
        BadRequest: ``text`` is not the string this format makes of an ID (a character outside the alphabet,
            several numbers, a number past ``2**63 - 1``, or not the canonical string of its number).
    """
    numbers = _SQIDS.decode(text) if text.isascii() else []
    if len(numbers) != 1 or not 0 <= numbers[0] <= MAX_SQID_ID or to_sqid(numbers[0]) != text:
        raise BadRequest(f"{text[:40]!r} is no ID in the sqids form (docs/permuted.md, 'The string form')")
    return numbers[0]
