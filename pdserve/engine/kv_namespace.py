"""The KV namespace of a request: which node-level KV layout and which tenant its blocks belong to.

A node's compatibility string names everything that makes two KV caches exchangeable (model,
dtype, block size, layout). Together with a request's optional `cache_salt` it is the root of the
request's block-key chain (engine.block_keys.namespace_root). The router computes the same root
from the string a node reports in LoadReport.compatibility, so it must be built here, once, and the
node must report exactly this string.
"""

from __future__ import annotations

from pdserve.engine.block_keys import BlockKey, namespace_root
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_config import ModelConfig

MAX_CACHE_SALT_BYTES = 256
"""Longest `cache_salt` (UTF-8 bytes), as on the wire (GenerateRequest / PrefillRequest)."""


def kv_compatibility(config: ModelConfig, pool: KVPool) -> str:
    """Two nodes may exchange KV (and share block keys) only when these strings are equal. The plane
    count (`;planes=1` for an MLA latent) is named only when it is not 2, so that the strings of
    K/V pools, and with them their block keys, stay what nodes without MLA support compute."""
    planes = "" if config.kv_planes == 2 else f";planes={config.kv_planes}"
    return (
        f"model={config.name};arch={config.architecture};vocab={config.vocab_size};"
        f"dtype={str(pool.dtype).replace('torch.', '')};"
        f"block_size={pool.block_size};layout=HND;layers={config.num_hidden_layers};"
        f"kv_heads={config.num_key_value_heads};head_dim={config.head_dim}{planes}"
    )


def request_root(compatibility: str, cache_salt: str | None) -> BlockKey:
    """The root of a request's key chain; ValueError for a salt over MAX_CACHE_SALT_BYTES."""
    if cache_salt is not None and len(cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes")
    return namespace_root(compatibility, cache_salt)
