"""The GPUDirect write flush against the real CUDA runtime (`cachestore.gpudirect`): the device's
own answer on whether GPUDirect writes need a flush, and the flush call itself. No NIC writes here
(none on the lent machines): this checks the runtime calls, not a NIC's ordering."""

from __future__ import annotations

import pytest

from pdserve.cachestore import gpudirect
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_the_runtime_answers_and_the_flush_succeeds() -> None:
    import torch

    torch.zeros(1, device="cuda:0")  # the primary context exists, as on a node
    try:
        flush = gpudirect.WriteFlush(0)
    except gpudirect.GpuDirectUnsupported as e:
        pytest.skip(f"this device cannot take GPUDirect safely: {e}")
    flush()
    assert flush.flushes == (1 if flush.needed else 0)
    if not flush.needed:  # still callable where the device orders its writes
        flush.needed = True
        flush()
        assert flush.flushes == 1
