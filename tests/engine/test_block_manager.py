from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager


def test_allocate_free_and_integrity():
    bm = BlockManager(8, 4)
    blocks, cached = bm.allocate(list(range(10)))
    assert len(blocks) == 3 and cached == 0 and bm.num_free_blocks == 5
    bm.check_integrity({"a": blocks})
    bm.free_blocks(blocks)
    assert bm.num_free_blocks == 8
    bm.check_integrity({})
    with pytest.raises(AssertionError):
        bm.free_blocks(blocks[:1])


def test_prefix_hit_requires_computed_full_blocks_and_never_covers_last_token():
    bm = BlockManager(16, 4)
    tokens = list(range(12))
    blocks, _ = bm.allocate(tokens)
    assert bm.prefix_hits(tokens) == []  # nothing computed yet: no hashes
    bm.cache_full_blocks(tokens, blocks, num_computed=12)
    # identical prompt: only 2 of 3 full blocks hit, the last token's block is recomputed
    assert bm.prefix_hits(tokens) == blocks[:2]
    other, cached = bm.allocate(tokens[:8] + [99, 98, 97, 96, 95])
    assert other[:2] == blocks[:2] and cached == 8
    assert bm.ref_counts[blocks[0]] == 2
    bm.check_integrity({"a": blocks, "b": other})
    # a different first block breaks the chain even if later blocks are equal
    assert bm.prefix_hits([7, 7, 7, 7] + tokens[4:]) == []


def test_lru_keeps_freed_cached_blocks_until_reused():
    bm = BlockManager(4, 2)
    a = list(range(5))
    blocks, _ = bm.allocate(a)
    bm.cache_full_blocks(a, blocks, 4)
    bm.free_blocks(blocks)
    assert bm.num_free_blocks == 4
    hits = bm.prefix_hits(a)
    assert hits == blocks[:2]  # still findable after free
    revived, cached = bm.allocate(a)
    assert cached == 4 and revived[:2] == blocks[:2]
    bm.free_blocks(revived)
    # exhausting the pool evicts cached blocks (least recently freed first) and drops their hashes
    fresh, _ = bm.allocate([50, 51, 52, 53, 54, 55, 56, 57])
    assert len(fresh) == 4 and bm.prefix_hits(a) == []
    bm.check_integrity({"x": fresh})


def test_can_allocate_counts_revived_blocks_and_reserve():
    bm = BlockManager(4, 2)
    assert bm.can_allocate(list(range(8)))
    assert not bm.can_allocate(list(range(8)), reserve=1)
    assert not bm.can_allocate(list(range(9)))
