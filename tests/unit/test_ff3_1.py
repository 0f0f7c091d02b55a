"""FF3-1 over 18 decimal digits on integers: the ``ff3`` package's output, bit for bit, one by one and in batches."""

from __future__ import annotations

import numpy as np
import pytest
from ff3 import FF3Cipher  # type: ignore[import-untyped]  # the oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from dispenser.core.ff3_1 import SPAN, FF31Cipher

keys = st.sampled_from([16, 24, 32]).flatmap(lambda size: st.binary(min_size=size, max_size=size))
tweaks = st.binary(min_size=7, max_size=7)
edges = st.sampled_from([0, 1, 9, 10, 10**9 - 1, 10**9, 10**9 + 1, 10**17, SPAN - 2, SPAN - 1])
values = st.one_of(st.integers(0, SPAN - 1), edges)


def oracle(key: bytes, tweak: bytes, value: int) -> int:
    """The ``ff3`` package's FF3-1 of ``value`` as 18 decimal digits."""
    return int(FF3Cipher(key.hex(), tweak.hex(), 10).encrypt(f"{value:018d}"))


# NIST's FF3 samples (FF3samples.pdf, also in the ff3 package's tests) over 18 decimal digits, plaintext
# 890121234567890000: FF3-1's rounds with FF3's 64-bit tweak given whole.
NIST_KEY = "EF4359D8D580AA4F7F036D6F04FC6A94"
NIST_FF3_SAMPLES = [
    (NIST_KEY, "D8E7920AFA330A73", 750918814058654607),
    (NIST_KEY, "9A768A92F60E12D8", 18989839189395384),
    (NIST_KEY + "2B7E151628AED2A6", "D8E7920AFA330A73", 646965393875028755),
    (NIST_KEY + "2B7E151628AED2A6", "9A768A92F60E12D8", 961610514491424446),
    (NIST_KEY + "2B7E151628AED2A6ABF7158809CF4F3C", "D8E7920AFA330A73", 922011205562777495),
    (NIST_KEY + "2B7E151628AED2A6ABF7158809CF4F3C", "9A768A92F60E12D8", 504149865578056140),
]


@pytest.mark.parametrize(("key", "tweak", "ciphertext"), NIST_FF3_SAMPLES)
def test_nist_samples_over_18_digits(key: str, tweak: str, ciphertext: int) -> None:
    """NIST's published FF3 samples of 18 decimal digits (AES-128, -192, -256) encipher and decipher."""
    cipher = FF31Cipher(bytes.fromhex(key), bytes.fromhex(tweak))
    assert cipher.encrypt(890121234567890000) == ciphertext
    assert cipher.decrypt(ciphertext) == 890121234567890000
    batch = cipher.encrypt_array(np.array([890121234567890000], dtype=np.uint64))
    assert batch.tolist() == [ciphertext]


def test_a_56_bit_tweak_is_ff3_1_s() -> None:
    """A 7-byte tweak is split as FF3-1 says (T_L, T_R, the middle byte's nibbles apart): pinned, the package's."""
    key, tweak = bytes.fromhex("2DE79D232DF5585D68CE47882AE256D6"), bytes.fromhex("CBD09280979564")  # ACVP's
    assert FF31Cipher(key, tweak).encrypt(3992520240) == oracle(key, tweak, 3992520240) == 570924449035371826


@settings(max_examples=300)
@given(keys, tweaks, values)
def test_encrypt_is_the_ff3_package_s(key: bytes, tweak: bytes, value: int) -> None:
    """For any AES key size, tweak and value of [0, 10**18), edges included: the package's ciphertext."""
    cipher = FF31Cipher(key, tweak)
    enciphered = cipher.encrypt(value)
    assert enciphered == oracle(key, tweak, value)
    assert cipher.decrypt(enciphered) == value


@settings(max_examples=100)
@given(keys, tweaks, values)
def test_decrypt_is_the_ff3_package_s(key: bytes, tweak: bytes, value: int) -> None:
    """Decryption is the package's decryption of any 18 digits, and encrypt undoes it: a bijection."""
    cipher = FF31Cipher(key, tweak)
    expected = int(FF3Cipher(key.hex(), tweak.hex(), 10).decrypt(f"{value:018d}"))
    assert cipher.decrypt(value) == expected
    assert cipher.encrypt(expected) == value


@settings(max_examples=50)
@given(keys, tweaks, st.lists(values, min_size=1, max_size=40), st.integers(0, SPAN - 1), st.integers(1, 300))
def test_a_batch_is_each_value_enciphered(
    key: bytes, tweak: bytes, scattered: list[int], start: int, run: int
) -> None:
    """encrypt_array of scattered values and of a run crossing many counters equals encrypt of each."""
    cipher = FF31Cipher(key, tweak)
    run_values = list(range(start, min(start + run, SPAN)))
    batch = scattered + run_values
    got = cipher.encrypt_array(np.array(batch, dtype=np.uint64)).tolist()
    assert got == [cipher.encrypt(v) for v in batch]
    assert got[: len(scattered)] == [oracle(key, tweak, v) for v in scattered]


def test_the_batch_agrees_at_the_edges_of_the_domain() -> None:
    """The first and the last 500 values, the whole half boundary: batch, one by one and the package agree."""
    key, tweak = bytes(range(32)), bytes(range(7))
    cipher = FF31Cipher(key, tweak)
    values = [*range(500), *range(10**9 - 250, 10**9 + 250), *range(SPAN - 500, SPAN)]
    got = cipher.encrypt_array(np.array(values, dtype=np.uint64)).tolist()
    assert got == [cipher.encrypt(v) for v in values]
    assert got[::50] == [oracle(key, tweak, v) for v in values[::50]]
    assert len(set(got)) == len(values)


def test_an_empty_batch_is_empty() -> None:
    """No values, no AES call needed: an empty array."""
    assert FF31Cipher(bytes(16), bytes(7)).encrypt_array(np.array([], dtype=np.uint64)).tolist() == []


@pytest.mark.parametrize("value", [-1, SPAN])
def test_values_outside_the_domain_are_refused(value: int) -> None:
    """Outside [0, 10**18) there is no 18-digit ciphertext: ValueError, both ways."""
    cipher = FF31Cipher(bytes(16), bytes(7))
    with pytest.raises(ValueError, match="0 to"):
        cipher.encrypt(value)
    with pytest.raises(ValueError, match="0 to"):
        cipher.decrypt(value)


@pytest.mark.parametrize(
    ("key", "tweak"), [(bytes(15), bytes(7)), (bytes(16), bytes(6)), (bytes(16), bytes(9))]
)
def test_bad_key_or_tweak_lengths_are_refused(key: bytes, tweak: bytes) -> None:
    """Only AES keys (16, 24, 32 bytes) and 56- or 64-bit tweaks."""
    with pytest.raises(ValueError, match="must be"):
        FF31Cipher(key, tweak)
