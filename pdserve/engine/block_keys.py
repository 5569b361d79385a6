"""Stable KV block keys: one versioned hash chain that every process computes alike.

A block key names the KV content of one full block of a prompt: it depends on the
block's token ids and, through its parent, on every token before it. The chain
starts at a namespace root (the KV compatibility of the node, so that KV of another
model, dtype or block size never matches, and the request's `cache_salt`, so that
tenants never share hits). The engine's prefix cache, the KV events a node publishes
and the router's index all use these functions, so a key computed by the router
equals the key a node stored.

Why blake2b-64 and not Python's `hash()`: `hash()` of a tuple is salted per process
for strings and may change between Python versions, so no other process could
recompute it. blake2b is in the standard library, and 64 bits keep the collision
chance negligible for any cache size a node can hold (~2^-30 at 2^17 blocks).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockKey = int

#: Bumped whenever the byte layout hashed below changes; part of every root, so keys
#: of two versions never compare equal.
BLOCK_KEY_VERSION = 1

_PERSON = b"pdserve-kv"  # blake2b personalisation: keys never equal other blake2b-64 uses


def _digest(data: bytes) -> BlockKey:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def namespace_root(compatibility: str, cache_salt: str | None = None) -> BlockKey:
    """The parent key of a prompt's first block.

    `compatibility` is the node's KV compatibility string (model, dtype, block size,
    layout); `cache_salt` the request's optional salt. A salt of None and of "" differ,
    so a salted request can never hit an unsalted block.
    """
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    body = compatibility.encode()
    return _digest(struct.pack("<BI", BLOCK_KEY_VERSION, len(body)) + body + salt)


def block_key(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    """Key of one full block whose tokens are `token_ids`, chained on `parent`."""
    return _digest(struct.pack(f"<Q{len(token_ids)}I", parent, *token_ids))


def prompt_block_keys(
    root: BlockKey, token_ids: Sequence[int], block_size: int, limit: int | None = None
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` (a trailing partial block has no key).

    `limit` caps how many keys are computed (a caller that only needs a prefix
    saves the hashing of the rest).
    """
    num_full = len(token_ids) // block_size
    if limit is not None:
        num_full = min(num_full, limit)
    keys: list[BlockKey] = []
    parent = root
    for i in range(num_full):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys
