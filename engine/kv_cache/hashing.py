"""Block hashes: a sha256 chain over full blocks of token ids, from a seeded root.

The router, the workers and the kvstore compute these independently and must agree byte for
byte, so this module is torch-free, pickle-free and defines its encoding exactly::

    root            = sha256(DOMAIN || u32le(len(seed_utf8)) || seed_utf8)
    hash(parent, t) = sha256(DOMAIN || parent(32 bytes)
                             || u32le(len(t)) || u32le(t[0]) || ... || u32le(t[-1])
                             || u32le(len(extra_keys)) || key_0 || key_1 || ...)
    key (int)       = b"i" || u32le(n) || n bytes, two's-complement little-endian (minimal n)
    key (str)       = b"s" || u32le(n) || utf-8 bytes
    key (bytes)     = b"b" || u32le(n) || bytes

Extra keys (a LoRA name, a cache salt, a multimodal content hash) go into every block's hash,
so requests that differ in them never share blocks. Changing this encoding changes every hash:
bump ``DOMAIN`` when doing so, and the golden-value tests will say which digests moved.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

DOMAIN = b"pdserve/block-hash/v1"
HASH_NUM_BYTES = 32
_MAX_TOKEN_ID = 2**32 - 1


def root_hash(seed: str = "") -> BlockHash:
    """The parent of a sequence's first block. Every process of a deployment uses the same seed."""
    seed_bytes = seed.encode("utf-8")
    return BlockHash(hashlib.sha256(DOMAIN + struct.pack("<I", len(seed_bytes)) + seed_bytes).digest())


ROOT_HASH: BlockHash = root_hash("")


def _encode_extra_key(key: object) -> bytes:
    # bool is an int subclass; rejecting it keeps True from silently hashing like 1.
    if isinstance(key, int) and not isinstance(key, bool):
        payload = key.to_bytes((key + (key < 0)).bit_length() // 8 + 1, "little", signed=True)
        tag = b"i"
    elif isinstance(key, str):
        payload, tag = key.encode("utf-8"), b"s"
    elif isinstance(key, bytes):
        payload, tag = key, b"b"
    else:
        raise TypeError(f"block-hash extra keys must be int, str or bytes, got {type(key).__name__}: {key!r}")
    return tag + struct.pack("<I", len(payload)) + payload


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()) -> BlockHash:
    """Hash of one block given its parent's hash (``ROOT_HASH`` for the first block).

    ``token_ids`` are non-negative ints below 2**32; ``extra_keys`` holds ints, strs or bytes.
    """
    if not isinstance(parent, bytes) or len(parent) != HASH_NUM_BYTES:
        raise TypeError(f"parent must be a {HASH_NUM_BYTES}-byte BlockHash, got {parent!r}")
    num_tokens = len(token_ids)
    try:
        encoded_tokens = struct.pack(f"<I{num_tokens}I", num_tokens, *token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token ids must be ints in [0, 2**32), got {bad!r}") from None
    h = hashlib.sha256(DOMAIN)
    h.update(parent)
    h.update(encoded_tokens)
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(_encode_extra_key(key))
    return BlockHash(h.digest())


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra_keys: tuple[object, ...] = (),
                        parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block gets none."""
    block_hashes: list[BlockHash] = []
    extend_block_hashes(block_hashes, token_ids, block_size, extra_keys, parent)
    return block_hashes


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[object, ...] = (), root: BlockHash = ROOT_HASH) -> int:
    """Append to ``block_hashes`` the hashes of blocks of ``token_ids`` that became full since.

    ``block_hashes`` must be the hashes of the leading blocks of ``token_ids`` (as a previous
    call left them), so a growing request pays for each block once. Returns how many were added.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    num_before = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else root
    for i in range(num_before, num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        block_hashes.append(parent)
    return len(block_hashes) - num_before
