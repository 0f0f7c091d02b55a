"""Permuted tags: a keyed, format-preserving permutation of a tag's counter, so IDs hide volume and order.

A permuted tag's ID is 19 decimal digits: the key epoch ``e`` (1 to :data:`MAX_EPOCH`) then
``FF3-1(key_e, tweak(tag), n)``, the counter ``n`` (``0 <= n < 10**18``) enciphered over 18 decimal digits
(NIST SP 800-38G Rev. 1, by :mod:`dispenser.core.ff3_1`): ``ID = e * 10**18 + FF3-1(n)``. Per epoch that is a
bijection of ``[0, 10**18)``, so distinct counters give distinct IDs; IDs of two epochs differ in their
first digit. Every ID is at least ``10**18`` (no plain counter reaches it) and below ``2**63``. Pure: the
key comes in as bytes (see ``docs/permuted.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dispenser.core.errors import BadRequest, TagExhausted
from dispenser.core.ff3_1 import DIGITS, SPAN, FF31Cipher

__all__ = [
    "DIGITS",
    "MAX_COUNTER",
    "MAX_EPOCH",
    "SPAN",
    "KeyFileError",
    "Permutation",
    "parse_key_file",
    "tweak_of",
]

MAX_COUNTER = SPAN - 1
"""The largest counter a permuted tag may reach."""

MAX_EPOCH = 8
"""The last key epoch: ``8 * 10**18 + (10**18 - 1)`` is below ``2**63``, epoch 9's IDs would not be."""

_KEY_BYTES = (16, 24, 32)

_BATCH_FROM = 4
"""From this many IDs, :meth:`Permutation.ids` enciphers them together (one AES call per round for all): below
it, one by one is cheaper than numpy's fixed cost (docs/benchmarks.md, "Permuted tags")."""


class KeyFileError(ValueError):
    """A permuted tag's key file is malformed (the message names the line, never the key)."""


def parse_key_file(text: str, where: str) -> dict[int, bytes]:
    """The keys by epoch in a key file's ``text``: lines ``EPOCH HEXKEY``, ``#`` comments, blank lines.

    A key is AES-128, -192 or -256 (32, 48 or 64 hex digits). ``where`` names the file in errors.

    Raises:
        KeyFileError: a line that is not an epoch 1 to 8 and a key of a valid length, an epoch given
            twice, or no key at all.
    """
    keys: dict[int, bytes] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[0].isdigit() or not 1 <= int(fields[0]) <= MAX_EPOCH:
            raise KeyFileError(
                f"{where}, line {number}: expected 'EPOCH HEXKEY' with an epoch 1 to {MAX_EPOCH}"
            )
        epoch = int(fields[0])
        try:
            key = bytes.fromhex(fields[1])
        except ValueError:
            key = b""
        if len(key) not in _KEY_BYTES:
            raise KeyFileError(f"{where}, line {number}: the key must be 32, 48 or 64 hex digits (AES)")
        if epoch in keys:
            raise KeyFileError(f"{where}, line {number}: epoch {epoch} is given twice")
        keys[epoch] = key
    if not keys:
        raise KeyFileError(f"{where}: no key (lines 'EPOCH HEXKEY')")
    return keys


def tweak_of(tag: str) -> str:
    """FF3-1's 56-bit tweak (hex), from the tag's name: one key shared by two tags still permutes each its own way."""
    return hashlib.sha256(tag.encode()).digest()[:7].hex()


class Permutation:
    """One tag's permutation under its keys; :attr:`epoch` (the highest key's) enciphers new IDs."""

    __slots__ = ("_ciphers", "epoch", "tag")

    def __init__(self, tag: str, keys: Mapping[int, bytes], epoch: int | None = None) -> None:
        """Permute ``tag``'s counters with ``keys`` (by epoch).

        Args:
            tag: the tag (its name is the tweak).
            keys: the key of each epoch; older epochs' keys decode older IDs.
            epoch: the epoch of new IDs (default: the highest in ``keys``).

        Raises:
            BadRequest: no key, an epoch outside 1 to 8, or ``epoch`` without a key.
        """
        if not keys or not all(1 <= e <= MAX_EPOCH for e in keys):
            raise BadRequest(f"a permuted tag needs keys of epochs 1 to {MAX_EPOCH}")
        self.tag = tag
        self.epoch = max(keys) if epoch is None else epoch
        if self.epoch not in keys:
            raise BadRequest(f"no key for epoch {self.epoch} of permuted tag {tag!r}")
        tweak = bytes.fromhex(tweak_of(tag))
        self._ciphers = {e: FF31Cipher(key, tweak) for e, key in keys.items()}

    def encode(self, counter: int, epoch: int | None = None) -> int:
        """The ID of ``counter`` under ``epoch`` (default: :attr:`epoch`).

        Raises:
            TagExhausted: the counter is outside ``[0, 10**18)`` (the tag ran past what a permuted tag holds).
        """
        if not 0 <= counter <= MAX_COUNTER:
            raise self._exhausted(counter, counter)
        e = self.epoch if epoch is None else epoch
        return e * SPAN + self._ciphers[e].encrypt(counter)

    def decode(self, permuted_id: int) -> tuple[int, int]:
        """The key epoch and the counter of ``permuted_id``.

        Raises:
            BadRequest: not a permuted ID (out of range), or of an epoch with no key here.
        """
        epoch, enciphered = divmod(permuted_id, SPAN)
        if not 1 <= epoch <= MAX_EPOCH:
            raise BadRequest(f"{permuted_id} is no permuted ID (19 digits, the first 1 to {MAX_EPOCH})")
        cipher = self._ciphers.get(epoch)
        if cipher is None:
            raise BadRequest(f"no key for epoch {epoch} of tag {self.tag!r}: add it to the tag's key file")
        return epoch, cipher.decrypt(enciphered)

    def ids(self, ranges: Iterable[Sequence[int]]) -> list[int]:
        """The IDs of every counter of ``ranges`` (inclusive ``(first, last)`` pairs), in order.

        Raises:
            TagExhausted: a counter outside ``[0, 10**18)``.
        """
        cipher = self._ciphers[self.epoch]
        base = self.epoch * SPAN
        spans = list(ranges)
        for first, last in spans:
            if first < 0 or last > MAX_COUNTER:
                raise self._exhausted(first, last)
        if sum(max(0, last - first + 1) for first, last in spans) < _BATCH_FROM:
            return [base + cipher.encrypt(n) for first, last in spans for n in range(first, last + 1)]
        counters = np.concatenate([np.arange(first, last + 1, dtype=np.uint64) for first, last in spans])
        # base + a ciphertext < 9 * 10**18 < 2**64: no overflow; tolist() gives Python ints.
        ids: list[int] = (cipher.encrypt_array(counters) + np.uint64(base)).tolist()
        return ids

    def _exhausted(self, first: int, last: int) -> TagExhausted:
        return TagExhausted(
            self.tag,
            f"permuted tag {self.tag!r}: counters {first}-{last} are past what a permuted tag holds "
            f"(0 to {MAX_COUNTER}); use a new tag",
        )
