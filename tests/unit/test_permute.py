"""Permuted tags' pure rules: a bijection per epoch, epochs apart, positive 63-bit IDs, the key file."""

from __future__ import annotations

import pytest
from ff3 import FF3Cipher  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from dispenser.core.errors import BadRequest, TagExhausted
from dispenser.core.permute import (
    MAX_COUNTER,
    MAX_EPOCH,
    SPAN,
    KeyFileError,
    Permutation,
    parse_key_file,
    tweak_of,
)

KEY1 = bytes.fromhex("2DE79D232DF5585D68CE47882AE256D6")
KEY2 = bytes.fromhex("EF4359D8D580AA4F7F036D6F04FC6A94")
KEYS = {1: KEY1, 2: KEY2}

counters = st.integers(0, MAX_COUNTER)
edge_counters = st.sampled_from([0, 1, 2, 9, 10, 10**17, MAX_COUNTER - 1, MAX_COUNTER])
any_counter = st.one_of(counters, edge_counters)
epochs = st.sampled_from([1, 2])

PERMUTATION = Permutation("order", KEYS)


@settings(max_examples=300)
@given(any_counter, epochs)
def test_decode_undoes_encode_over_the_whole_space(counter: int, epoch: int) -> None:
    """decode(encode(n)) == (epoch, n) for any counter of [0, 10**18), its edges included: injective."""
    permuted = PERMUTATION.encode(counter, epoch)
    assert PERMUTATION.decode(permuted) == (epoch, counter)


@settings(max_examples=300)
@given(st.integers(0, MAX_COUNTER), epochs)
def test_every_id_of_an_epoch_is_some_counters(enciphered: int, epoch: int) -> None:
    """Every 19-digit value of an epoch decodes to a counter that encodes back to it: onto, so a bijection."""
    permuted = epoch * SPAN + enciphered
    got_epoch, counter = PERMUTATION.decode(permuted)
    assert got_epoch == epoch
    assert 0 <= counter <= MAX_COUNTER
    assert PERMUTATION.encode(counter, epoch) == permuted


@settings(max_examples=200)
@given(any_counter, any_counter, epochs, epochs)
def test_no_two_counters_or_epochs_share_an_id(a: int, b: int, epoch_a: int, epoch_b: int) -> None:
    """Two (epoch, counter) pairs give one ID only if they are the same pair: no ID repeats across a rotation."""
    same = PERMUTATION.encode(a, epoch_a) == PERMUTATION.encode(b, epoch_b)
    assert same == ((a, epoch_a) == (b, epoch_b))


@settings(max_examples=200)
@given(any_counter, st.integers(1, MAX_EPOCH))
def test_ids_are_positive_63_bit_and_above_every_plain_counter(counter: int, epoch: int) -> None:
    """Every permuted ID is in [10**18, 2**63): positive, a signed 64-bit integer, never a plain counter."""
    permutation = Permutation("order", {epoch: KEY1})
    permuted = permutation.encode(counter)
    assert SPAN <= permuted < 2**63
    assert permuted // SPAN == epoch


def test_the_cipher_is_the_ff3_1_package_s() -> None:
    """The enciphered digits are FF3-1's (the ``ff3`` package, radix 10) under the key and the tag's tweak."""
    permutation = Permutation("order", {1: KEY1})
    expected = FF3Cipher(KEY1.hex(), tweak_of("order"), 10).encrypt(f"{12345:018d}")
    assert permutation.encode(12345) == SPAN + int(expected)


@settings(max_examples=100)
@given(st.sampled_from([16, 24, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)), any_counter)
def test_ids_are_the_ff3_package_s_for_any_key_size(key: bytes, counter: int) -> None:
    """For AES-128, -192 and -256 keys, encode and a batch around the counter are the ``ff3`` package's digits."""
    permutation = Permutation("order", {3: key})
    oracle = FF3Cipher(key.hex(), tweak_of("order"), 10)
    first, last = max(0, counter - 2), min(MAX_COUNTER, counter + 2)
    expected = [3 * SPAN + int(oracle.encrypt(f"{n:018d}")) for n in range(first, last + 1)]
    assert permutation.encode(counter) == 3 * SPAN + int(oracle.encrypt(f"{counter:018d}"))
    assert permutation.ids([(first, last)]) == expected


def test_the_documented_example_still_decodes() -> None:
    """docs/permuted.md's example: tag order, epoch 1's key 2de7…56d6, counter 17 is 1909854577332565212."""
    permutation = Permutation("order", {1: KEY1})
    assert permutation.decode(1909854577332565212) == (1, 17)
    assert permutation.encode(17) == permutation.ids([(17, 17)])[0] == 1909854577332565212


@settings(max_examples=60)
@given(st.lists(st.tuples(any_counter, st.integers(0, 40)), max_size=6))
def test_ids_of_any_ranges_are_encode_of_each_counter(starts: list[tuple[int, int]]) -> None:
    """Any ranges, one by one or batched (short or long, at the space's edges): encode of each counter, in order."""
    ranges = [(first, min(MAX_COUNTER, first + length - 1)) for first, length in starts]
    expected = [PERMUTATION.encode(n) for first, last in ranges for n in range(first, last + 1)]
    assert PERMUTATION.ids(ranges) == expected


def test_a_large_batch_is_a_bijection_and_decodes() -> None:
    """10,000 consecutive counters batched: 10,000 distinct IDs, each decoding to its counter."""
    ids = PERMUTATION.ids([(MAX_COUNTER - 9_999, MAX_COUNTER)])
    assert len(set(ids)) == 10_000
    assert [PERMUTATION.decode(i) for i in ids[::97]] == [
        (2, MAX_COUNTER - 9_999 + k) for k in range(0, 10_000, 97)
    ]
    assert ids[::1000] == [PERMUTATION.encode(MAX_COUNTER - 9_999 + k) for k in range(0, 10_000, 1000)]


def test_consecutive_counters_do_not_give_increasing_ids() -> None:
    """A run of counters gives IDs in no order and far apart (what hides volume and order)."""
    ids = PERMUTATION.ids([(1, 200)])
    assert len(set(ids)) == 200
    assert ids != sorted(ids)
    assert max(ids) - min(ids) > 10**16


def test_ids_equals_encode_of_each_counter() -> None:
    """ids(ranges) is encode of each counter, in order, with the current epoch."""
    assert PERMUTATION.epoch == 2
    assert PERMUTATION.ids([(5, 7), (100, 100)]) == [PERMUTATION.encode(n) for n in (5, 6, 7, 100)]


def test_tags_permute_differently_under_one_key() -> None:
    """The tag's name is the tweak: two tags sharing a key do not share a permutation."""
    assert Permutation("a", KEYS).ids([(1, 20)]) != Permutation("b", KEYS).ids([(1, 20)])


@pytest.mark.parametrize("counter", [-1, MAX_COUNTER + 1])
def test_counters_past_the_space_are_refused(counter: int) -> None:
    """A counter outside [0, 10**18) is tag_exhausted, never an ID of another epoch."""
    with pytest.raises(TagExhausted):
        PERMUTATION.encode(counter)
    with pytest.raises(TagExhausted):
        PERMUTATION.ids([(MAX_COUNTER, counter)] if counter > 0 else [(counter, 0)])


@pytest.mark.parametrize("value", [0, 1, SPAN - 1, 9 * SPAN, 2**63 - 1])
def test_decode_refuses_what_is_no_permuted_id(value: int) -> None:
    """A number without a valid epoch digit is refused by decode."""
    with pytest.raises(BadRequest):
        PERMUTATION.decode(value)


def test_decode_of_an_epoch_without_key_is_refused() -> None:
    """An ID of an epoch whose key is not in the file cannot be decoded, and says which epoch."""
    with pytest.raises(BadRequest, match="epoch 3"):
        PERMUTATION.decode(3 * SPAN + 5)


def test_the_epoch_of_new_ids_needs_its_key() -> None:
    """A permutation whose epoch has no key is refused at once."""
    with pytest.raises(BadRequest):
        Permutation("order", {1: KEY1}, epoch=2)
    with pytest.raises(BadRequest):
        Permutation("order", {9: KEY1})


def test_key_file_parses_epochs_and_keys() -> None:
    """Lines 'EPOCH HEXKEY', comments and blank lines; AES-128, -192 and -256 keys."""
    text = f"# order's keys\n1 {KEY1.hex()}\n\n2 {'ab' * 24}  # rotated\n3 {'cd' * 32}\n"
    assert parse_key_file(text, "k") == {1: KEY1, 2: bytes.fromhex("ab" * 24), 3: bytes.fromhex("cd" * 32)}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only a comment\n",
        "1\n",
        "0 " + "ab" * 16,
        "9 " + "ab" * 16,
        "1 abc",
        "1 " + "zz" * 16,
        "x " + "ab" * 16,
        f"1 {'ab' * 16}\n1 {'cd' * 16}\n",
    ],
)
def test_malformed_key_files_are_refused_without_the_key(text: str) -> None:
    """A malformed key file is refused, its message naming the file and never the key's digits."""
    with pytest.raises(KeyFileError) as info:
        parse_key_file(text, "/etc/order.keys")
    assert "/etc/order.keys" in str(info.value)
    assert "abab" not in str(info.value)
    assert "cdcd" not in str(info.value)
