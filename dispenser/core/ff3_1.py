"""FF3-1 (NIST SP 800-38G Rev. 1) over exactly 18 decimal digits, on integers: one ID, or a batch at once.

The same function as the ``ff3`` package's ``FF3Cipher(key, tweak, 10)`` on 18-digit strings (the tests hold
it to the package and to NIST's sample vectors), without its digit strings: the halves are kept as the
integers ``NUM(REV(A))`` and ``NUM(REV(B))``, so a round is one AES block and a sum modulo ``10**9``, and a
batch enciphers every counter's round in one AES-ECB call (numpy for the arithmetic). Why, and what it
costs: docs/permuted.md.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
from Crypto.Cipher import AES

__all__ = ["DIGITS", "SPAN", "FF31Cipher", "U64Array"]

DIGITS: Final = 18
"""Decimal digits enciphered."""

SPAN: Final = 10**DIGITS
"""The domain: ``[0, SPAN)``."""

U64Array = npt.NDArray[np.uint64]
"""A batch of values: a one-dimensional array of ``uint64``."""

_ROUNDS = 8
_HALF: Final = 10**9  # radix**u = radix**v: 18 digits split into u = v = 9
_HALF_U64 = np.uint64(_HALF)
_TWO64_MOD_HALF = np.uint64(2**64 % _HALF)
_KEY_BYTES = (16, 24, 32)


def _digit_reversals() -> U64Array:
    """REV of every 5-digit string as an integer: ``table[12] == 21000`` (``"00012"`` read backwards)."""
    rest = np.arange(100_000, dtype=np.uint64)
    table = np.zeros_like(rest)
    ten = np.uint64(10)
    for _ in range(5):
        rest, digit = np.divmod(rest, ten)
        table = table * ten + digit
    return table


_REV5 = _digit_reversals()


def _rev9(value: int) -> int:
    """``NUM(REV(STR(value)))`` over 9 decimal digits (an involution on ``[0, 10**9)``)."""
    return int(f"{value:09d}"[::-1])


def _rev9_array(values: U64Array) -> U64Array:
    """:func:`_rev9` of each value: the last 5 digits reversed lead, then the first 4 reversed."""
    low: U64Array = _REV5[values % np.uint64(100_000)]
    high: U64Array = _REV5[values // np.uint64(100_000)]
    # high < 10**4 reads as "0hhhh", whose reversal "hhhh0" is 10 times the 4 digits reversed.
    return low * np.uint64(10_000) + high // np.uint64(10)


class FF31Cipher:
    """FF3-1 over radix 10 and 18 digits under one AES key and one tweak; integers in, integers out.

    Round ``i`` (NIST SP 800-38G Rev. 1, Algorithm 9) on ``a = NUM(REV(A))`` and ``b = NUM(REV(B))``:
    ``P = (W xor [i]^4) || [b]^12``, ``y = NUM(REVB(AES_REVB(K)(REVB(P))))``, then ``a, b = b, (a + y) mod
    10**9``. ``REVB(P)`` is ``b`` as 12 little-endian bytes and then ``W xor [i]^4`` reversed, and ``y`` is
    the AES output read as a little-endian integer, so no digit string is built but at the ends.
    """

    __slots__ = ("_aes", "_round_tails", "_round_words")

    def __init__(self, key: bytes, tweak: bytes) -> None:
        """Encipher under ``key`` (AES-128, -192 or -256) and ``tweak``.

        Args:
            key: 16, 24 or 32 bytes.
            tweak: 7 bytes (FF3-1's 56-bit tweak), or 8 (FF3's 64-bit one, which NIST withdrew: accepted
                so that NIST's FF3 samples over 18 digits, the same rounds, can test this code).

        Raises:
            ValueError: a key or a tweak of another length.
        """
        if len(key) not in _KEY_BYTES:
            raise ValueError("the key must be 16, 24 or 32 bytes (AES)")
        if len(tweak) == 7:  # T_L = T[0..27] || 0^4, T_R = T[32..55] || T[28..31] || 0^4
            left = tweak[:3] + bytes([tweak[3] & 0xF0])
            right = tweak[4:] + bytes([(tweak[3] & 0x0F) << 4])
        elif len(tweak) == 8:
            left, right = tweak[:4], tweak[4:]
        else:
            raise ValueError("the tweak must be 7 bytes (FF3-1) or 8 (FF3)")
        self._aes = AES.new(key[::-1], AES.MODE_ECB)
        tails = []
        for i in range(_ROUNDS):
            w = right if i % 2 == 0 else left
            tails.append((w[:3] + bytes([w[3] ^ i]))[::-1])  # REVB of W xor [i]^4: the block's last 4 bytes
        self._round_tails: tuple[bytes, ...] = tuple(tails)
        # The block's second little-endian 64-bit word: bytes 8-11 are b's top (zero: b < 2**64), then the tail.
        self._round_words = tuple(np.uint64(int.from_bytes(tail, "little") << 32) for tail in tails)

    def encrypt(self, value: int) -> int:
        """The ciphertext of ``value`` (``0 <= value < 10**18``).

        Raises:
            ValueError: ``value`` outside the domain.
        """
        a, b = self._halves(value)
        aes = self._aes
        out = bytearray(16)  # encrypt(output=) saves an allocation per round (~1 µs of ~2.5)
        for tail in self._round_tails:
            aes.encrypt(b.to_bytes(12, "little") + tail, output=out)
            a, b = b, (a + int.from_bytes(out, "little")) % _HALF
        return _rev9(a) * _HALF + _rev9(b)

    def decrypt(self, value: int) -> int:
        """The plaintext of ``value`` (``0 <= value < 10**18``): the rounds backwards, subtracting.

        Raises:
            ValueError: ``value`` outside the domain.
        """
        a, b = self._halves(value)
        aes = self._aes
        out = bytearray(16)
        for tail in reversed(self._round_tails):
            aes.encrypt(a.to_bytes(12, "little") + tail, output=out)
            a, b = (b - int.from_bytes(out, "little")) % _HALF, a
        return _rev9(a) * _HALF + _rev9(b)

    def encrypt_array(self, values: U64Array) -> U64Array:
        """:meth:`encrypt` of each value (each ``< 10**18``, unchecked), one AES-ECB call per round for all.

        Worth it from a few values on (numpy's fixed cost per call, ~60 µs); a new array, ``values`` untouched.
        """
        count = len(values)
        a = _rev9_array(values // _HALF_U64)
        b = _rev9_array(values % _HALF_U64)
        # REVB(P) as two little-endian 64-bit words a block: b, then the round's tail.
        blocks: U64Array = np.empty((count, 2), dtype="<u8")
        out: U64Array = np.empty((count, 2), dtype="<u8")
        plain, ciphered = blocks.reshape(-1).view(np.uint8).data, out.reshape(-1).view(np.uint8).data
        for word in self._round_words:
            blocks[:, 0] = b
            blocks[:, 1] = word
            self._aes.encrypt(plain, output=ciphered)
            # y mod 10**9 from y = hi * 2**64 + lo: each term below 10**18, the sum below 2**64.
            y = (out[:, 1] % _HALF_U64) * _TWO64_MOD_HALF + out[:, 0] % _HALF_U64
            a, b = b, (a + y) % _HALF_U64
        result: U64Array = _rev9_array(a) * _HALF_U64 + _rev9_array(b)
        return result

    @staticmethod
    def _halves(value: int) -> tuple[int, int]:
        if not 0 <= value < SPAN:
            raise ValueError(f"FF3-1 here enciphers 0 to {SPAN - 1}, not {value}")
        high, low = divmod(value, _HALF)
        return _rev9(high), _rev9(low)
