"""Each GPU test hands the card back whole: the next test may start node processes, which see only
what the driver reports free, not what this process's caching allocator (or an engine still held by a
reference cycle) keeps."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _return_the_card() -> Iterator[None]:
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
