"""Residue classes: a tag whose IDs are ``offset`` modulo ``stride``, so that databases never share an ID.

``leaf_alloc.max_id`` stays a high water of IDs (a fetch of ``step`` IDs moves it by ``step * stride``),
and the double buffer holds ordinals: :meth:`Residue.to_ordinals` and :meth:`Residue.ids` map between
them; ``stride = 1, offset = 0`` is Leaf's tag. See ``docs/datacenters.md`` (topology 3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from dispenser.core.ids import IdBatch, Range
from dispenser.core.segment import Segment

__all__ = ["LEAF", "MAX_STRIDE", "Residue", "StridedRange"]

MAX_STRIDE = 2**15
"""A bound that keeps ``step * stride`` far inside ``bigint`` (steps are ``int``) and catches typos."""


@dataclass(frozen=True, slots=True)
class StridedRange:
    """IDs ``first, first + stride, …, last``: ``last - first`` is a multiple of ``stride``."""

    first: int
    last: int
    stride: int

    def __post_init__(self) -> None:
        if self.stride < 1 or self.first > self.last or (self.last - self.first) % self.stride:
            raise ValueError(f"not a strided range: [{self.first}, {self.last}] by {self.stride}")

    @property
    def count(self) -> int:
        """How many IDs the range holds."""
        return (self.last - self.first) // self.stride + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first, self.last + 1, self.stride))

    def to_list(self) -> list[int]:
        """The IDs one by one (for the ``ids`` reply format)."""
        return list(range(self.first, self.last + 1, self.stride))


@dataclass(frozen=True, slots=True)
class Residue:
    """The residue class a tag hands out in one database: IDs ``x`` with ``x % stride == offset``."""

    stride: int = 1
    offset: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.stride <= MAX_STRIDE:
            raise ValueError(f"stride must be between 1 and {MAX_STRIDE}, got {self.stride}")
        if not 0 <= self.offset < self.stride:
            raise ValueError(
                f"offset must be between 0 and stride - 1 ({self.stride - 1}), got {self.offset}"
            )

    @property
    def plain(self) -> bool:
        """Whether this is Leaf's tag (every ID), for which every map is the identity."""
        return self.stride == 1

    def advance(self, step: int) -> int:
        """How far ``max_id`` moves for a segment of ``step`` IDs."""
        return step * self.stride

    def grant(self, max_id: int, step: int) -> StridedRange:
        """The IDs granted by ``UPDATE … SET max_id = max_id + step * stride RETURNING max_id``.

        The members of the class in ``[max_id - step * stride, max_id - 1]``: exactly ``step`` of them.
        """
        if step < 1:
            raise ValueError(f"step must be at least 1, got {step}")
        low = max_id - self.advance(step)
        if low < 0:
            raise ValueError(f"max_id {max_id} is below a segment of {step} IDs by {self.stride}")
        first = low + (self.offset - low) % self.stride
        return StridedRange(first, first + (step - 1) * self.stride, self.stride)

    def owns(self, id_: int) -> bool:
        """Whether ``id_`` belongs to this class."""
        return id_ >= 0 and id_ % self.stride == self.offset

    def intersects(self, other: Residue) -> bool:
        """Whether some ID is in both classes: ``o1 ≡ o2 (mod gcd(s1, s2))`` (the Chinese remainder theorem).

        Two databases serving one tag in intersecting classes hand out the same IDs; Leaf's tag (0 mod 1)
        intersects every class.
        """
        return (self.offset - other.offset) % math.gcd(self.stride, other.stride) == 0

    def first_common(self, other: Residue) -> int | None:
        """The smallest ID of both classes (``None``: they are disjoint), to name one in a message."""
        g = math.gcd(self.stride, other.stride)
        difference = other.offset - self.offset
        if difference % g:
            return None
        # x = offset + stride * k with stride * k ≡ difference (mod other.stride); divide through by g.
        modulus = other.stride // g
        k = (difference // g) * pow(self.stride // g, -1, modulus) % modulus
        return (self.offset + self.stride * k) % (self.stride // g * other.stride)

    def ordinal(self, id_: int) -> int:
        """The ``k`` for which ``id_ == k * stride + offset``."""
        if not self.owns(id_):
            raise ValueError(f"{id_} is not {self.offset} modulo {self.stride}")
        return (id_ - self.offset) // self.stride

    def id_of(self, ordinal: int) -> int:
        """The ``ordinal``-th member of the class (from 0)."""
        return ordinal * self.stride + self.offset

    def to_ordinals(self, granted: StridedRange) -> Segment:
        """The contiguous segment of ordinals the double buffer holds for ``granted``."""
        if granted.stride != self.stride:
            raise ValueError(f"a range by {granted.stride} given to a class by {self.stride}")
        return Segment(self.ordinal(granted.first), self.ordinal(granted.last))

    def batch(self, ordinals: IdBatch) -> IdBatch:
        """The IDs of a batch the buffer handed out (of ordinals), as one-ID ranges unless the class is Leaf's.

        Ranges of a strided class are not contiguous; one-ID ranges are read right by every reader of the
        ``ranges`` format, which promises contiguous ``[first, last]`` pairs (docs/datacenters.md).
        """
        if self.stride == 1:  # self.plain, without a property call on every request
            return ordinals
        return IdBatch(tuple((i, i) for r in ordinals.ranges for i in self.ids(r)))

    def ids(self, ordinals: Range) -> StridedRange:
        """The IDs of an inclusive range of ordinals, as the buffer hands it out."""
        first, last = ordinals
        return StridedRange(self.id_of(first), self.id_of(last), self.stride)


LEAF = Residue()
"""Leaf's tag: stride 1, offset 0."""
