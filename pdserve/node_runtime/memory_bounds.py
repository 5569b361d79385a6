"""Bounds on the per-shape state CPU inference keeps, so a node's memory stays flat under load.

`benchmarks/soak.py` found prefill nodes growing with the number of distinct prompt lengths they had
seen (docs/benchmark-log.md, "Soak"): oneDNN's primitive cache and ideep's LRU cache (torch's mkldnn
linear) each keep up to 1,024 compiled kernels per shape, and glibc's dynamic mmap threshold lets
the freed activations of every new size stay in the heap. Capping both caches and fixing the mmap
threshold made the same load flat. A variable the operator already set is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("pdserve.node")
SHAPE_CACHE_CAPACITY = "128"
"""Kernels kept per cache: every batch size of a decode node and the common prompt lengths of a
prefill node, without growing with every new length."""
CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's and ideep's cache capacities; both libraries read them at their first kernel."""
MMAP_THRESHOLD = 1 << 20
"""Allocations from 1 MiB up get their own mapping, returned to the system when freed."""
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def bound_shape_caches() -> None:
    """Call before the engine runs its first kernel (the caches read their capacity once)."""
    for name in CACHE_ENV:
        os.environ.setdefault(name, SHAPE_CACHE_CAPACITY)
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (e.g. musl): its allocator has no such threshold
        log.debug("mallopt is not available; the heap keeps its own threshold")
