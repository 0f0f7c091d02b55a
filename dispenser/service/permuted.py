"""Permuted tags on a worker: their keys read from ``segment.permute_keys_dir``, their IDs permuted per batch.

A tag is permuted when the directory holds ``<tag>.keys`` (docs/permuted.md); the files are read once, at
start (a key rotation is a new line in the file and a rolling restart). The dispatcher asks here only when
it first sees a tag, so plain tags pay nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dispenser.core.daily import DailyPolicy
from dispenser.core.errors import BadRequest
from dispenser.core.permute import KeyFileError, Permutation, parse_key_file
from dispenser.core.residue import LEAF, Residue
from dispenser.core.tags import TAG_PATTERN
from dispenser.messages import Kind
from dispenser.ports import Allocation, SegmentStore, TagInfo

__all__ = [
    "KEY_SUFFIX",
    "MarkingStore",
    "PermutedBatch",
    "PermutedMarks",
    "key_file",
    "load_permutation",
    "load_permutations",
]

KEY_SUFFIX = ".keys"
"""A permuted tag's key file is ``<segment.permute_keys_dir>/<tag>.keys``."""


@dataclass(frozen=True, slots=True)
class PermutedBatch:
    """A permuted tag's IDs as a batch: one ``(id, id)`` range per ID, in the order they were drawn."""

    ranges: Sequence[tuple[int, int]]
    ids: list[int]
    """The same IDs as a list: an ``ids`` reply takes them as they are (flattening 10,000 ranges back costs ~1.4 ms)."""

    @classmethod
    def of(cls, ids: list[int]) -> PermutedBatch:
        """The batch of ``ids``."""
        return cls([(i, i) for i in ids], ids)


def key_file(directory: str | Path, tag: str) -> Path:
    """The path of ``tag``'s key file in ``directory``."""
    return Path(directory) / f"{tag}{KEY_SUFFIX}"


def load_permutation(directory: str | Path, tag: str) -> Permutation:
    """``tag``'s permutation from its key file in ``directory``.

    Raises:
        BadRequest: no key file for the tag, or a malformed one (the message never holds a key).
    """
    path = key_file(directory, tag)
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise BadRequest(f"tag {tag!r} is not permuted here: no key file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRequest(f"cannot read the key file {path}: {type(exc).__name__}") from None
    try:
        return Permutation(tag, parse_key_file(text, str(path)))
    except KeyFileError as exc:
        raise BadRequest(str(exc)) from None


def load_permutations(directory: str | Path | None) -> dict[str, Permutation]:
    """Every permuted tag's permutation: one per ``<tag>.keys`` file in ``directory`` (None: none).

    Raises:
        BadRequest: the directory is missing, a file's name is no valid tag, or a file is malformed: the
            worker must not start and serve a permuted tag's counters plain.
    """
    if directory is None:
        return {}
    root = Path(directory)
    if not root.is_dir():
        raise BadRequest(f"segment.permute_keys_dir {root} is not a directory")
    permutations: dict[str, Permutation] = {}
    for path in sorted(root.glob(f"*{KEY_SUFFIX}")):
        tag = path.name.removesuffix(KEY_SUFFIX)
        if TAG_PATTERN.fullmatch(tag) is None:
            raise BadRequest(f"{path}: {tag!r} is no valid tag name")
        permutations[tag] = load_permutation(root, tag)
    return permutations


class PermutedMarks:
    """The tags the store marks permuted (``TagInfo.permuted``), learnt from each tag list before the allocator.

    :class:`MarkingStore` updates it from every ``list_tags`` the allocator makes, before the allocator learns
    a tag from that list; the dispatcher refuses a marked tag it has no key for, and forgets a tag it had
    remembered as plain once it is marked (``on_marked``).
    """

    def __init__(self) -> None:
        """No tag marked yet."""
        self.tags: set[str] = set()
        """The marked tags (updated in place)."""
        self.on_marked: list[Callable[[str], object]] = []
        """Called with each newly marked tag."""

    def observe(self, infos: Iterable[TagInfo]) -> None:
        """Take in a tag list: its marked tags replace the known ones."""
        marked = {info.tag for info in infos if info.permuted}
        for tag in marked - self.tags:
            for call in self.on_marked:
                call(tag)
        self.tags.intersection_update(marked)
        self.tags.update(marked)


class MarkingStore:
    """A :class:`~dispenser.ports.SegmentStore` that shows every tag list to :class:`PermutedMarks` first."""

    def __init__(self, store: SegmentStore, marks: PermutedMarks) -> None:
        """Wrap ``store``."""
        self._store = store
        self._marks = marks

    async def list_tags(self) -> list[TagInfo]:
        """The store's tags, their marks taken in before they are returned."""
        infos = await self._store.list_tags()
        self._marks.observe(infos)
        return infos

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        """The store's."""
        return await self._store.next_segment(tag, step, above=above)

    async def return_unused(self, tag: str, ranges: Sequence[tuple[int, int]], worker: str) -> int:
        """The store's."""
        return await self._store.return_unused(tag, ranges, worker)

    async def add_tag(
        self,
        tag: str,
        step: int,
        start: int = 1,
        description: str = "",
        *,
        residue: Residue = LEAF,
        daily: DailyPolicy | None = None,
        permuted: bool = False,
    ) -> TagInfo:
        """The store's."""
        return await self._store.add_tag(
            tag, step, start, description, residue=residue, daily=daily, permuted=permuted
        )

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """The store's."""
        return await self._store.set_step(tag, step)

    async def set_daily(self, tag: str, daily: DailyPolicy) -> TagInfo:
        """The store's."""
        return await self._store.set_daily(tag, daily)

    async def set_permuted(self, tag: str, permuted: bool) -> TagInfo:
        """The store's."""
        return await self._store.set_permuted(tag, permuted)

    async def remove_tag(self, tag: str) -> None:
        """The store's."""
        await self._store.remove_tag(tag)

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """The store's."""
        await self._store.save_peaks(kind, peaks)

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """The store's."""
        return await self._store.load_peaks(kind)

    async def close(self) -> None:
        """The store is the worker's: left open."""
