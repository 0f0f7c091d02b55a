"""Permuted tags on a worker: their keys read from ``segment.permute_keys_dir``, their IDs permuted per batch.

A tag is permuted when the directory holds ``<tag>.keys`` (docs/permuted.md); the files are read once, at
start (a key rotation is a new line in the file and a rolling restart). The dispatcher asks here only when
it first sees a tag, so plain tags pay nothing per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dispenser.core.errors import BadRequest
from dispenser.core.permute import KeyFileError, Permutation, parse_key_file
from dispenser.core.tags import TAG_PATTERN

__all__ = ["KEY_SUFFIX", "PermutedBatch", "key_file", "load_permutation", "load_permutations"]

KEY_SUFFIX = ".keys"
"""A permuted tag's key file is ``<segment.permute_keys_dir>/<tag>.keys``."""


@dataclass(frozen=True, slots=True)
class PermutedBatch:
    """A permuted tag's IDs as a batch: one ``(id, id)`` range per ID, in the order they were drawn."""

    ranges: Sequence[tuple[int, int]]


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
