"""bound_shape_caches caps the per-shape kernel caches unless the operator already chose a size."""

from __future__ import annotations

import os

from pdserve.node_runtime import memory_bounds


def test_caches_are_capped_and_an_operator_setting_wins(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # set: mallopt is left alone
    memory_bounds.bound_shape_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == memory_bounds.SHAPE_CACHE_CAPACITY
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
