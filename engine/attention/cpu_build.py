"""Builds (once, cached) and loads the C++ paged-attention op for CPU.

The op is compiled lazily on first use with `torch.utils.cpp_extension`, into a
cache directory keyed by the source digest and the torch version, so later
processes load the built library in milliseconds. When no C++ compiler exists or
the build fails, `load_paged_attention_op()` returns None and the `cpu_paged`
backend falls back to the pure-torch path: a missing compiler never stops a node.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
_op: Callable[..., torch.Tensor] | None = None
_tried = False


def build_dir() -> Path:
    """Cache location of the built op: `$PDSERVE_CACHE_DIR/kernels/<digest>` (default ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    return root / "kernels" / f"cpu_paged-{digest}"


def load_paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.pdserve_cpu.paged_attention`, building it on first call; None if it cannot be built."""
    global _op, _tried
    if _tried:
        return _op
    _tried = True
    if os.environ.get("PDSERVE_NO_CPU_KERNEL") == "1":  # lets tests and users force the fallback
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: cpu_paged attention uses the pure-torch fallback")
        return None
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        # torch's builder takes a file lock in `out`, so concurrent first uses build once
        load(name="pdserve_cpu_paged", sources=[str(SOURCE)], build_directory=str(out),
             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 — any build failure means "use the fallback"
        log.warning("building the cpu_paged attention op failed (%s): using the pure-torch fallback", exc)
        return None
    _op = torch.ops.pdserve_cpu.paged_attention
    return _op
