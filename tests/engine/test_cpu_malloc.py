"""pdserve.engine.cpu_malloc: freed activation-sized blocks are reused, not faulted in again."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.engine.cpu_malloc import keep_freed_memory

# Runs in a fresh interpreter, so the heap is not shaped by whatever tests ran before in this
# process and glibc's thresholds are at their documented start. A step's activations are four 16 MB
# blocks, written and freed in reverse. They are taken from glibc directly (torch's CPU allocator is
# malloc too), so that nothing else lands on the heap above them. The probe reports how many bytes
# the first step had mmap'd, how much the heap grew for it and kept once it was freed (both from
# mallinfo2), and the page faults of 20 later steps.
_PROBE = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    from pdserve.engine.cpu_malloc import keep_freed_memory

    MB = 1 << 20

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def allocate():
        blocks = [libc.malloc(16 * MB) for _ in range(4)]
        for block in blocks:
            ctypes.memset(block, 1, 16 * MB)
        return blocks

    def release(blocks):
        for block in reversed(blocks):
            libc.free(block)

    if sys.argv[1] == "keep":
        assert keep_freed_memory() and keep_freed_memory()  # applied, and idempotent
    heap = libc.mallinfo2().arena
    blocks = allocate()
    mapped = libc.mallinfo2().hblkhd
    release(blocks)
    kept = libc.mallinfo2().arena - heap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # 20 x 16 thousand pages touched
        release(allocate())
    print(json.dumps({"mapped": mapped, "kept": kept,
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
    """
)


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    except OSError:
        return False


def _probe(mode: str) -> dict[str, int]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        # glibc's own defaults, whatever the environment tunes
        env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _has_mallinfo2() -> bool:
    return _glibc() and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="the settings are glibc's (mallinfo2: glibc >= 2.33)")
def test_activation_sized_blocks_come_from_the_heap_and_stay_there():
    default = _probe("default")
    # The probe discriminates: glibc starts with a 128 KB mmap threshold, so its first 16 MB blocks
    # are mmap'd (and munmap'd when freed), and once that threshold has risen it trims the freed heap
    # top beyond twice the block, so later steps fault pages in again.
    assert default["mapped"] >= 64 << 20 and default["kept"] < 16 << 20, default
    assert default["faults"] > 100_000, default
    kept = _probe("keep")
    assert kept["mapped"] < 16 << 20, f"16 MB blocks were mmap'd despite the settings: {kept}"
    assert kept["kept"] >= 64 << 20, f"the heap gave back freed blocks: {kept}"
    # 327 thousand pages touched
    assert kept["faults"] < 8192, f"freed blocks are not being reused: {kept}"


def test_keep_freed_memory_is_idempotent_in_this_process():
    first = keep_freed_memory()
    assert keep_freed_memory() == first
    assert first == _glibc()
