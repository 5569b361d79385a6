"""Builds (once, cached) and loads the C++ ops for CPU: paged attention and the fused elementwise ops.

Both sources compile into one library (`torch.ops.pdserve_cpu.*`), so there is
one build, one cache entry and one fallback decision for all of them.

The op is compiled on first use with `torch.utils.cpp_extension`, into a cache
directory keyed by the source digest and the torch version, so later processes
only load the built library. The first build takes about a minute, so it runs on
a background thread (`start_build`): a node starts serving at once on the
pure-torch path and switches to the op when it is loaded. When no C++ compiler
exists or the build fails, the op stays None and the `cpu_paged` backend keeps
the pure-torch path: a missing compiler never stops a node.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_paged_attention.cpp", CSRC / "cpu_fused_ops.cpp")
HEADERS = (CSRC / "cpu_common.h",)
"""Included by the sources: part of the cache key, so that editing one rebuilds the op."""
_op: Callable[..., torch.Tensor] | None = None
_tried = False
_lock = threading.Lock()
_thread: threading.Thread | None = None


def build_dir() -> Path:
    """Cache location of the built op: `$PDSERVE_CACHE_DIR/kernels/<digest>` (default ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    digest = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:12]
    return root / "kernels" / f"cpu_paged-{digest}"


def start_build() -> None:
    """Build/load the op on a daemon thread (idempotent); `current_op()` returns it once ready."""
    global _thread
    with _lock:
        if _thread is None and not _tried:
            _thread = threading.Thread(target=load_paged_attention_op, name="cpu-paged-build", daemon=True)
            _thread.start()


def current_op() -> Callable[..., torch.Tensor] | None:
    """The op if it is loaded by now, else None (never blocks)."""
    return _op


def load_paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.pdserve_cpu.paged_attention`, building it if needed (blocks); None if it cannot be built."""
    global _op, _tried
    with _lock:  # one build per process; a second caller waits for the first
        if not _tried:
            _op = _build()
            _tried = True
        return _op


def _build() -> Callable[..., torch.Tensor] | None:
    if os.environ.get("PDSERVE_NO_CPU_KERNEL") == "1":  # lets tests and users force the fallback
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: cpu_paged attention uses the pure-torch fallback")
        return None
    from torch.utils.cpp_extension import load

    out = build_dir()
    library = out / "pdserve_cpu_paged.so"
    try:
        if library.exists():  # built before, by this or another process
            torch.ops.load_library(str(library))
            return torch.ops.pdserve_cpu.paged_attention
        # Build in a directory of this process's own, then rename it into place. torch's builder
        # would share a lock file instead, and a process killed mid-build (a node SIGKILLed in
        # its first minute) would leave that lock behind and stall every later build forever.
        tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
        _remove_dead_builds(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        load(
            name="pdserve_cpu_paged",
            sources=[str(s) for s in SOURCES],
            build_directory=str(tmp),
            extra_cflags=["-O3", "-fopenmp"],
            extra_include_paths=[str(CSRC)],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        if out.exists() and not library.exists():  # debris of an interrupted build: not a result
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)  # atomic; fails if a concurrent build got there first, which is fine
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 — any build failure means "use the fallback"
        log.warning("building the cpu_paged attention op failed (%s): using the pure-torch fallback", exc)
        return None
    return torch.ops.pdserve_cpu.paged_attention


def _remove_dead_builds(out: Path) -> None:
    """Delete the private build directories of processes that no longer exist."""
    for stale in out.parent.glob(f"{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
