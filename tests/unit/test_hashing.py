"""Block hashes: golden digests (router, workers and kvstore must agree byte for byte) and properties."""

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kv_cache.hashing import (
    DOMAIN,
    ROOT_HASH,
    extend_block_hashes,
    hash_block_tokens,
    hash_request_blocks,
    root_hash,
)

# Computed once from the documented encoding; a change here changes every deployed hash.
GOLDEN_ROOT = "e043a0d38f036cc8bb8984f61a0e61015719c17d3f49b2ce3748356b8dc7d1b7"
GOLDEN_ROOT_PROD = "f996c385beb65a269d3c10b40d7ac48ec22649e18085dbb5efca4fb7d220c8bf"
GOLDEN_1234 = "86ba78603a0274546cbbfb57a3c85cf1024940056c79759a6c777f723123221a"
GOLDEN_1234_5678 = "d8b1104171cfcd187f4fbe4faea0480899b500b243bd23fee958255864355bad"
GOLDEN_1234_EXTRA = "30b7013f3e073dfc73e1d259bd7a2ac532b2829cf6657cc04744c5e76abf5bd2"
GOLDEN_EMPTY = "10d7697df26d6736864f3b0fabd8c3b76afd0fd1dbd6f1e48ea5bc7750f79e4d"
GOLDEN_EXTREMES = "e9310cbd599eb26e933716c8f8b2d67e44e58469f1e853e50484c2130fadd7c3"
GOLDEN_NEG_KEY = "dd81fe578633860b5ae1fbf0e434ea1d4cdd615dc4d8960e692dc22049503a57"
GOLDEN_BIG_KEY = "e87eb1a240aaab21939f61e0f1dfbfa61ca602f36ab7d648889ff6a9689477e0"
GOLDEN_SALTED_0123 = "b4a4182abf4c11517acd7b44cd1e8d9b3eac4ea7d517bbb5b98d367563d85a6c"


def test_golden_digests():
    assert ROOT_HASH.hex() == GOLDEN_ROOT
    assert root_hash("").hex() == GOLDEN_ROOT
    assert root_hash("prod").hex() == GOLDEN_ROOT_PROD
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1.hex() == GOLDEN_1234
    assert hash_block_tokens(h1, [5, 6, 7, 8]).hex() == GOLDEN_1234_5678
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (7, "lora-a", b"\x00salt")).hex() == GOLDEN_1234_EXTRA
    assert hash_block_tokens(ROOT_HASH, []).hex() == GOLDEN_EMPTY
    assert hash_block_tokens(ROOT_HASH, [0, 2**32 - 1]).hex() == GOLDEN_EXTREMES
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (-1,)).hex() == GOLDEN_NEG_KEY
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (2**70,)).hex() == GOLDEN_BIG_KEY


def test_encoding_matches_the_documented_spec():
    # A reimplementation from the module docstring, as another language would write it.
    def u32(n):
        return struct.pack("<I", n)

    root = hashlib.sha256(DOMAIN + u32(4) + b"prod").digest()
    keys = b"i" + u32(1) + b"\x07" + b"s" + u32(6) + b"lora-a" + b"b" + u32(5) + b"\x00salt" + b"i" + u32(1) + b"\xff"
    expected = hashlib.sha256(DOMAIN + root + u32(3) + u32(10) + u32(20) + u32(30) + u32(4) + keys).digest()
    assert hash_block_tokens(root_hash("prod"), [10, 20, 30], (7, "lora-a", b"\x00salt", -1)) == expected


def test_request_blocks_are_full_blocks_only_and_chained():
    hashes = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert [h.hex() for h in hashes] == [GOLDEN_1234, GOLDEN_1234_5678]
    assert hash_request_blocks([1, 2, 3], block_size=4) == []
    assert hash_request_blocks([1, 2, 3, 4], 4, parent=root_hash("prod")) != hashes[:1]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.lists(st.integers(0, 2**32 - 1), max_size=12),
       st.sampled_from([1, 2, 4, 8]))
def test_prefix_property(prefix, suffix, block_size):
    full = hash_request_blocks(prefix + suffix, block_size)
    assert hash_request_blocks(prefix, block_size) == full[:len(prefix) // block_size]
    assert len(full) == len(prefix + suffix) // block_size
    assert all(len(h) == 32 for h in full)


def test_extend_block_hashes_pays_once_per_block():
    tokens = list(range(11))
    hashes = []
    assert extend_block_hashes(hashes, tokens[:5], 4) == 1
    assert extend_block_hashes(hashes, tokens[:7], 4) == 0
    assert extend_block_hashes(hashes, tokens, 4) == 1
    assert hashes == hash_request_blocks(tokens, 4)


def test_any_difference_changes_the_hash():
    base = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 5]) != base
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3]) != base
    assert hash_block_tokens(root_hash("x"), [1, 2, 3, 4]) != base
    with_key = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("a",))
    assert with_key != base
    # Type tags and lengths keep look-alike keys apart.
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (b"a",)) != with_key
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (97,)) != with_key
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("ab",)) != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("a", "b"))
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (1, 2)) != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], (2, 1))
    # Extra keys reach every block of a request, not just the first.
    plain, keyed = hash_request_blocks(list(range(8)), 4), hash_request_blocks(list(range(8)), 4, ("a",))
    assert plain[0] != keyed[0] and plain[1] != keyed[1]


@pytest.mark.parametrize("key", [1.5, None, True, (1, 2), [1], {"a": 1}])
def test_unsupported_extra_keys_raise_type_error(key):
    with pytest.raises(TypeError, match="extra keys"):
        hash_block_tokens(ROOT_HASH, [1], (key,))


@pytest.mark.parametrize("token", [-1, 2**32, 1.0])
def test_bad_token_ids_raise(token):
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(ROOT_HASH, [1, token])


def test_bad_parent_raises():
    with pytest.raises(TypeError, match="parent"):
        hash_block_tokens(b"short", [1])
    with pytest.raises(TypeError, match="parent"):
        hash_block_tokens(None, [1])


def test_cache_salt_goes_into_every_block_hash():
    from engine.sampling_params import SamplingParams

    salted = SamplingParams(cache_salt="tenant-a")
    assert salted.block_hash_extra_keys == ("tenant-a",)
    assert SamplingParams().block_hash_extra_keys == ()
    tokens = list(range(8))
    plain = hash_request_blocks(tokens, 4)
    a = hash_request_blocks(tokens, 4, salted.block_hash_extra_keys)
    b = hash_request_blocks(tokens, 4, ("tenant-b",))
    assert len({plain[0], a[0], b[0]}) == 3 and len({plain[1], a[1], b[1]}) == 3
    # Pinned: the router and the workers hash a salted prompt to these bytes.
    assert a[0].hex() == GOLDEN_SALTED_0123
    assert a[1] == hash_block_tokens(a[0], [4, 5, 6, 7], ("tenant-a",))
