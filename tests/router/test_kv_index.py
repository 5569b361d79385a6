"""KvIndex: leading-run matching, only synced nodes, and bounded memory."""

from __future__ import annotations

from pdserve.router.kv_index import KvIndex


def test_match_counts_the_leading_run_of_synced_nodes_only():
    index = KvIndex()
    index.replace("a", [1, 2, 3])
    index.replace("b", [1, 3])  # holds 3 but not 2: only the first block is a prefix hit
    index.store("c", [1, 2, 3])  # never synced (no complete snapshot): cold
    assert index.match([1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 1, "c": 0, "d": 0}
    index.suspend("a")
    assert index.match([1, 2, 3], ["a"]) == {"a": 0}
    index.resume("a")
    assert index.match([1, 2, 3], ["a"]) == {"a": 3}


def test_remove_clear_and_drop_keep_the_size_exact():
    index = KvIndex()
    index.replace("a", [1, 2, 3])
    index.replace("b", [1, 2])
    index.remove("a", [2, 99])  # 99 was never held: ignored
    assert index.size == 4 and index.match([1, 2], ["a", "b"]) == {"a": 1, "b": 2}
    index.clear("b")
    assert index.size == 2 and index.is_synced("b")
    index.drop("a")
    assert index.size == 0 and not index.is_synced("a") and index.match([1], ["a"]) == {"a": 0}


def test_node_cap_and_global_cap_forget_the_oldest_keys():
    index = KvIndex(max_entries=10)
    index.set_capacity("a", 4)
    index.replace("a", range(100, 110))  # a node can never hold more keys than its pool's blocks
    assert index.node_size("a") == 4
    index.replace("b", range(8))
    assert index.size == 10 and index.node_size("b") == 6  # the largest node gives up its oldest keys
    assert index.evicted == 8
    assert index.match([0, 1, 2], ["b"])["b"] == 0  # forgetting only ever under-estimates a hit
