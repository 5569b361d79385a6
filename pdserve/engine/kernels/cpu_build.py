"""Builds (once, cached) and loads the C++ ops for CPU: paged attention and the fused elementwise ops.

All sources compile into one library (`torch.ops.pdserve_cpu.*`), so there is
one build, one cache entry and one fallback decision for all of them.

The op is compiled on first use with `torch.utils.cpp_extension`, into a cache
directory keyed by the source digest and the torch version, so later processes
only load the built library; concurrent processes on one cache directory compile once, under a
file lock (`build_once`). The first build takes about a minute, so it runs on
a background thread (`start_build`): a node starts serving at once on the
pure-torch path and switches to the op when it is loaded. When no C++ compiler
exists or the build fails, the op stays None and the `cpu_paged` backend keeps
the pure-torch path: a missing compiler never stops a node.
"""

from __future__ import annotations

import fcntl
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
SOURCES = (
    CSRC / "cpu_paged_attention.cpp",
    CSRC / "cpu_prefill_attention.cpp",
    CSRC / "cpu_fused_ops.cpp",
    CSRC / "cpu_float_carry.cpp",
    CSRC / "cpu_amx_linear.cpp",
    CSRC / "cpu_amx_prefill.cpp",
    CSRC / "cpu_f32_linear.cpp",
)
HEADERS = (
    CSRC / "cpu_common.h",
    CSRC / "cpu_vec.h",
    CSRC / "cpu_prefill.h",
    CSRC / "cpu_amx.h",
    CSRC / "cpu_packed.h",
)
"""Included by the sources: part of the cache key, so that editing one rebuilds the op."""
LIBRARY = "pdserve_cpu_paged.so"
built_in_this_process = False
"""Whether this process compiled the ops (False when it loaded another process's build)."""
_op: Callable[..., torch.Tensor] | None = None
_tried = False
_kernels: dict[str, bool] = {}
"""What this CPU grants each optional kernel (`_kernel_ready`), asked once the ops are loaded."""
_lock = threading.Lock()
_thread: threading.Thread | None = None


CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")
"""-fno-trapping-math: without it GCC will not if-convert the clamp before `fast_exp`'s float->int
conversion (which could trap on an out-of-range value), so the AVX2 and baseline clones of every
loop that calls it stayed scalar (SiLU-mul ran 4.5x slower than torch's eager ops on an AVX2 CPU);
only the AVX-512 clone, with masked ops, was vectorised. No result changes: nothing here reads the
floating-point exception flags, and rounding is untouched."""

LDFLAGS = ("-fopenmp", "-Wl,--exclude-libs,ALL")
"""--exclude-libs: a toolchain that links libstdc++ statically into shared objects (seen on a GPU
image whose g++ is a wrapper) would otherwise export that copy's symbols, and the dynamic linker
binds some of them to the process's own libstdc++: the two copies' locales mix, and formatting an
integer into an error message lost the number (Debian, g++ 12) or crashed the process (that image). Kept
local, the static copy is self-contained; a normal build links no static library and is unchanged."""


def build_dir() -> Path:
    """Cache location of the built op: `$PDSERVE_CACHE_DIR/kernels/<digest>` (default ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    flags = " ".join(CFLAGS + LDFLAGS).encode()
    digest = hashlib.sha256(text + flags + torch.__version__.encode()).hexdigest()[:12]
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


def amx_linear_ready() -> bool:
    """Whether `torch.ops.pdserve_cpu.amx_linear` can run now: the ops are loaded and this CPU and
    kernel grant AMX bf16 tiles (asked once, then cached; False while the ops are still building)."""
    return _kernel_ready("amx_available")


def f32_linear_ready() -> bool:
    """Whether `torch.ops.pdserve_cpu.f32_linear` can run now: the ops are loaded and this CPU has
    AVX-512 (asked once, then cached; False while the ops are still building)."""
    return _kernel_ready("f32_linear_available")


def _kernel_ready(probe: str) -> bool:
    """The answer of the loaded ops' `probe` (a `() -> bool` op), asked once; False before they load."""
    if probe not in _kernels:
        if _op is None:
            return False
        _kernels[probe] = bool(getattr(torch.ops.pdserve_cpu, probe)())
    return _kernels[probe]


def load_paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.pdserve_cpu.paged_attention`, building it if needed (blocks); None if it cannot be built."""
    global _op, _tried
    with _lock:  # one build per process; a second caller waits for the first
        if not _tried:
            _op = _build()
            _tried = True
        return _op


def _build() -> Callable[..., torch.Tensor] | None:
    global built_in_this_process
    if os.environ.get("PDSERVE_NO_CPU_KERNEL") == "1":  # lets tests and users force the fallback
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: cpu_paged attention uses the pure-torch fallback")
        return None
    out = build_dir()
    library = out / LIBRARY
    try:
        built_in_this_process = build_once(out, _compile)
        if not built_in_this_process:  # torch's builder loaded what it compiled; a cached build is loaded here
            torch.ops.load_library(str(library))
    except Exception as exc:  # noqa: BLE001 — any build failure means "use the fallback"
        log.warning("building the cpu_paged attention op failed (%s): using the pure-torch fallback", exc)
        return None
    return torch.ops.pdserve_cpu.paged_attention


def build_once(out: Path, compile_into: Callable[[Path], None]) -> bool:
    """Make `out/LIBRARY` exist, compiling it at most once per cache directory; True if this call compiled.

    Concurrent processes serialise on an `fcntl.flock` of `<out>.lock`: the first compiles, the
    others wait and then find the library. The compile goes into a directory of this process's own
    that is renamed to `out` only when complete, so `out` is never half-written. The kernel drops a
    flock when its holder dies, so a process killed mid-build (a node SIGKILLed in its first minute)
    never stalls later builds (torch's own builder leaves a lock file behind that does).
    """
    if (out / LIBRARY).exists():  # built before, by this or another process: no lock needed
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process compiles
        try:
            if (out / LIBRARY).exists():  # that other process finished it
                return False
            _remove_dead_builds(out)
            tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
            tmp.mkdir()
            try:
                compile_into(tmp)
                if not (tmp / LIBRARY).exists():
                    raise RuntimeError(f"the build produced no {LIBRARY}")
                shutil.rmtree(out, ignore_errors=True)  # debris of an interrupted build, never a result
                tmp.rename(out)  # atomic: readers see no library or a whole one
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile(build_directory: Path) -> None:
    """torch.utils.cpp_extension's build of the sources into `build_directory` (about a minute)."""
    from torch.utils.cpp_extension import load

    log.info("compiling the CPU ops into %s (once per cache directory)", build_directory)
    load(
        name=LIBRARY.removesuffix(".so"),
        sources=[str(s) for s in SOURCES],
        build_directory=str(build_directory),
        # copies: torch's builder appends its own libraries to the lists it is given, which changed
        # this process's `build_dir()` after a compile (a second load compiled again elsewhere)
        extra_cflags=list(CFLAGS),
        extra_include_paths=[str(CSRC)],
        extra_ldflags=list(LDFLAGS),
        is_python_module=False,
        verbose=False,
    )


def _remove_dead_builds(out: Path) -> None:
    """Delete private build directories left by killed builds (called under the lock, so none is live)."""
    for stale in out.parent.glob(f"{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
