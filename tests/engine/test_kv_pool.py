"""The CPU KV pool's memory: zeroed, and backed by transparent huge pages where Linux allows it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.kv_pool import HUGE_PAGE, KVPool, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_allowed() -> bool:
    return sys.platform.startswith("linux") and THP.is_file() and "[never]" not in THP.read_text()


def test_pool_is_zeroed_and_shaped():
    cfg = SimpleNamespace(num_key_value_heads=2, head_dim=16, kv_planes=2)  # all the pool reads of a model's config
    pool = KVPool(cfg, 2, 16, torch.bfloat16, torch.device("cpu"), num_blocks=2048)  # type: ignore[arg-type]  # 8 MiB
    assert pool.tensor.shape == (2, 2048, 2, 2, 16, 16)
    assert pool.tensor.dtype == torch.bfloat16
    assert not pool.tensor.any()


@pytest.mark.skipif(not _thp_allowed(), reason="transparent huge pages are off or this is not Linux")
def test_advice_covers_the_aligned_interior_only():
    big = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8)  # holds at least one aligned 2 MiB page
    assert advise_huge_pages(big)
    small = torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)  # no whole aligned page inside
    assert not advise_huge_pages(small)
    assert not advise_huge_pages(torch.empty(0))
