"""What the rdma transport registers for a pool: the pool itself, or a pinned host staging buffer.

  * host pool: the pool's memory, registered as it is ("host");
  * CUDA pool, GPUDirect RDMA available: the CUDA pool itself, registered through the NIC driver's
    peer-memory client (nvidia-peermem), so the NIC reads and writes GPU memory ("gpudirect");
  * CUDA pool otherwise: pinned host memory, allocated and registered once ("staging"). The sender
    copies each run device-to-host into its lane's slot of the buffer (on a side stream that first
    waits on the layer's CUDA event, on the lane's thread, never the engine's) and WRITEs from
    there; the receiver registers a host mirror of its pool (as large as the pool: the price of
    staging without GPUDirect), the senders' WRITEs land there, and each NOTIFY copies its blocks
    host-to-device before it is acknowledged.

The choice is made at start (`choose`), logged, and exported as the label `mode` of
`pdserve_cachestore_rdma_pool_memory`. GPUDirect is taken when a peer-memory client is loaded (or
$PDSERVE_RDMA_GPUDIRECT=on) AND registering the CUDA pool succeeds AND, on a receiver, the NIC's
writes can be made visible to the GPU (`cachestore.gpudirect`: the device orders them, or flushes
them after each NOTIFY); $PDSERVE_RDMA_GPUDIRECT=off forces staging. dma-buf registration
(ibv_reg_dmabuf_mr) is not implemented.

NOT EXERCISED on RDMA hardware: GPUDirect has never run, and nothing here has run on a GPU with an
RDMA NIC. Pinned staging with real CUDA pools ran on an H100 over the emulated verbs device
(`tests/gpu/test_cuda_rdma.py`, with torch's pinned allocator), and the exact-size `cudaHostRegister`
pinning that replaced it ran there on an H200 on 2026-11-26; on CPU, the tests
drive it with a pool that reports itself as device memory. The emulated device has no peer-memory
client, so it never takes GPUDirect.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cachestore import gpudirect

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdserve.cachestore")

GPUDIRECT_ENV = "PDSERVE_RDMA_GPUDIRECT"
STAGING_ENV = "PDSERVE_RDMA_STAGING_BYTES"
HOST, GPUDIRECT, STAGING = "host", "gpudirect", "staging"
PEER_MEMORY_PATHS = ("/sys/module/nvidia_peermem", "/sys/kernel/mm/memory_peers/nv_mem")
"""nvidia-peermem loaded (or the older nv_peer_mem): ibv_reg_mr accepts CUDA pointers."""
DEFAULT_STAGING_BYTES = 16 << 20
"""A sender lane's staging slot: a run larger than this goes in several WRITEs."""


def peer_memory_support(v) -> tuple[bool, str]:
    """Whether this verbs provider can register CUDA memory, and why (or why not)."""
    if getattr(v, "EMULATED", False):
        return False, "the emulated verbs device has no peer-memory client"
    for path in PEER_MEMORY_PATHS:
        if os.path.exists(path):
            return True, f"peer-memory client present ({path})"
    return False, "no peer-memory client loaded (nvidia-peermem)"


def choose(v, region) -> tuple[str, str]:
    """(mode, reason) for `region`, before any registration (see the module docstring)."""
    if not region.is_device:
        return HOST, "host memory pool"
    setting = os.environ.get(GPUDIRECT_ENV, "auto").lower()
    if setting == "off":
        return STAGING, f"${GPUDIRECT_ENV}=off"
    ok, why = peer_memory_support(v)
    if ok or setting == "on":
        return GPUDIRECT, why if ok else f"${GPUDIRECT_ENV}=on"
    return STAGING, why


@dataclass
class PoolRegistration:
    """The registered memory the QPs use for a pool, and how it maps to the pool."""

    mode: str
    reason: str
    mr: Any
    """The verbs MR (pyverbs has no types)."""
    address: int
    """Base address of the registered memory (the pool's, or the staging buffer's)."""
    length: int
    staging: torch.Tensor | None = None
    """The host buffer (a uint8 tensor) in mode "staging"."""
    slot_bytes: int = 0
    """Sender: bytes of each lane's slot of `staging` (0 on the receiver: `staging` mirrors the pool)."""
    flush: gpudirect.WriteFlush | None = None
    """Receiver in mode "gpudirect": makes the NIC's writes visible to the GPU (`RdmaReceiver.landed`)."""


HOST_MEMORY_HEADROOM = 0.9
"""A staging buffer may take at most this share of the host's available memory: beyond it the
kernel's OOM killer, not an error message, would end the node."""


def _host_buffer(nbytes: int, what: str):
    """`nbytes` of host memory, pinned exactly when CUDA is present; ValueError when the host has not
    that much available. Not `torch.empty(pin_memory=True)`: torch's caching host allocator rounds
    every allocation up to a power of two, so a 34 GiB pool mirror pinned 64 GiB, and two nodes'
    mirrors on one host pinned more than the machine had (the nodes died without a word)."""
    import torch

    available = _available_host_bytes()
    if nbytes > available * HOST_MEMORY_HEADROOM:
        raise ValueError(
            f"the rdma {what} needs {nbytes / 2**30:.1f} GiB of pinned host memory, but the host has "
            f"{available / 2**30:.1f} GiB available: give the KV pool less (--gpu-memory-utilization, "
            f"--kv-cache-memory), run fewer nodes per host, or use GPUDirect RDMA (no host copy)"
        )
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        _pin_exactly(buf)
    return buf


def _available_host_bytes() -> int:
    """MemAvailable (Linux; restated from pdserve.engine.kv_sizing: the cachestore imports nothing from the
    engine)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _pin_exactly(buf: torch.Tensor) -> None:
    """Page-lock `buf` in place (cudaHostRegister), and unlock it when the tensor object goes:
    unlocking early at worst makes a later copy synchronous; unlocking late would act on freed memory."""
    import weakref

    import torch

    cudart = torch.cuda.cudart()
    ptr = int(buf.data_ptr())
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, buf.numel(), 0))  # 0: cudaHostRegisterDefault
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)


def register(v, pd, region, access: int, *, lanes: int = 0, block_bytes: int = 1) -> PoolRegistration:
    """Register `region` for the rdma transport. `lanes` > 0: a sender, whose staging buffer holds
    one slot per lane; 0: a receiver, whose staging buffer mirrors the whole pool."""
    mode, reason = choose(v, region)
    flush = None
    if mode == GPUDIRECT and not lanes:  # a receiver: NICs write its pool, the GPU must see it
        try:
            flush = gpudirect.WriteFlush(region.tensor.device.index or 0, gpudirect.load_cudart())
        except gpudirect.GpuDirectUnsupported as e:
            mode, reason = STAGING, f"GPUDirect writes cannot be made visible ({e})"
    if mode == GPUDIRECT:
        address = int(region.tensor.data_ptr())
        try:
            mr = v.MR(pd, len(region), access, address=address)
            return PoolRegistration(mode, reason, mr, address, len(region), flush=flush)
        except Exception as e:  # PyverbsRDMAError: the driver refused device memory
            mode, reason = STAGING, f"registering the CUDA pool failed ({e})"
    if mode == HOST:
        return PoolRegistration(
            mode, reason, v.MR(pd, len(region), access, address=region.address), region.address, len(region)
        )
    if lanes:
        slot = int(os.environ.get(STAGING_ENV, DEFAULT_STAGING_BYTES))
        slot = max(block_bytes, min(slot, len(region)) // block_bytes * block_bytes)
        buf = _host_buffer(slot * lanes, "sender's staging slots")
    else:
        slot, buf = 0, _host_buffer(len(region), "receiver's mirror of its CUDA pool")
    address = int(buf.data_ptr())
    return PoolRegistration(
        mode, reason, v.MR(pd, buf.numel(), access, address=address), address, buf.numel(), buf, slot
    )


_streams: dict = {}
"""The receiver's host-to-device copy stream per device (NOTIFYs are handled by worker threads)."""


def commit(reg: PoolRegistration, tensor, spans: list[tuple[int, int]]) -> None:
    """Receiver, staging: copy the landed pool byte spans (start, nbytes) from the host mirror into the
    device pool; returns once the copies are done (the NOTIFY is acknowledged after)."""
    import torch

    assert reg.staging is not None, "commit() serves the staging mode"
    flat = tensor.view(torch.uint8).view(-1)
    if flat.is_cuda:
        stream = _streams.get(flat.device)
        if stream is None:
            stream = _streams[flat.device] = torch.cuda.Stream(device=flat.device)
        with torch.cuda.stream(stream):
            for start, n in spans:
                flat[start : start + n].copy_(reg.staging[start : start + n], non_blocking=True)
        stream.synchronize()
    else:
        for start, n in spans:
            flat[start : start + n].copy_(reg.staging[start : start + n])


def report(reg: PoolRegistration, metrics, side: str) -> None:
    """Log the registration chosen and export it as the metric label `mode`."""
    log.info("rdma %s registers %s memory (%s)", side, reg.mode, reg.reason)
    metrics.set_pool_memory(reg.mode)
