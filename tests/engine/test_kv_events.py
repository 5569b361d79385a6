"""The block manager publishes stored/removed events that replay to its cached key set."""

from __future__ import annotations

import threading

from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KvEventKind, KvEventLog


def _replay(log: KvEventLog) -> set[int]:
    held: set[int] = set()
    for e in log.since(0) or []:
        if e.kind is KvEventKind.STORED:
            held.update(e.keys)
        elif e.kind is KvEventKind.REMOVED:
            held.difference_update(e.keys)
        else:
            held.clear()
    return held


def test_stored_events_carry_the_chain_and_replay_to_the_cache() -> None:
    log = KvEventLog()
    bm = BlockManager(num_blocks=6, block_size=4, events=log)
    root = namespace_root("model=m", "salt")
    tokens = list(range(13))
    blocks, _ = bm.allocate(tokens, root=root)
    bm.cache_full_blocks(tokens, blocks, num_computed=8, root=root)
    bm.cache_full_blocks(tokens, blocks, num_computed=12, root=root)  # only the third block is new
    keys = prompt_block_keys(root, tokens, 4)
    events = log.since(0)
    assert events is not None and [e.keys for e in events] == [tuple(keys[:2]), (keys[2],)]
    assert events[0].parent_key == root and events[1].parent_key == keys[1]
    assert [e.seq for e in events] == [1, 2]
    assert _replay(log) == set(bm.hash_to_block) == log.snapshot().keys
    # a hit in another namespace is impossible; in the same one it is found
    assert bm.prefix_hits(tokens, root=namespace_root("model=m", None)) == []
    assert bm.prefix_hits(tokens, root=root) == blocks[:3]


def test_eviction_publishes_removed_and_the_buffer_gap_asks_for_a_snapshot() -> None:
    log = KvEventLog(capacity=2)
    bm = BlockManager(num_blocks=2, block_size=4, events=log)
    a = [1, 2, 3, 4, 5]
    blocks, _ = bm.allocate(a)
    bm.cache_full_blocks(a, blocks, 4)
    bm.free_blocks(blocks)
    b = [9, 9, 9, 9, 9, 9, 9, 9, 9]
    more, _ = bm.allocate(b[:8])  # takes both blocks: the cached one is evicted
    assert [e.kind for e in log.since(0) or []] == [KvEventKind.STORED, KvEventKind.REMOVED]
    assert log.snapshot().keys == frozenset()
    log.cleared()  # a third event pushes seq 1 out of the 2-event buffer
    assert log.since(0) is None  # a subscriber that far behind must take a snapshot
    assert [e.seq for e in log.since(1) or []] == [2, 3]
    assert log.since(log.seq + 5) is None  # a number from another incarnation
    bm.free_blocks(more)
    bm.check_integrity()


def test_wait_wakes_on_a_new_event() -> None:
    log = KvEventLog()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(log.wait(0, timeout=10)))
    t.start()
    log.cleared()
    t.join(timeout=10)
    assert got and got[0] is not None and [e.kind for e in got[0]] == [KvEventKind.CLEARED]  # type: ignore[attr-defined]
