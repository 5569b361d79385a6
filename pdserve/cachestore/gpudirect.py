"""Making GPUDirect RDMA writes visible to the GPU before its kernels read them.

A NIC writing into GPU memory (GPUDirect RDMA) completes its WRITEs from the network's point of
view before the GPU is guaranteed to see the bytes: on devices that do not order such writes
natively, CUDA documents a flush, `cudaDeviceFlushGPUDirectRDMAWrites(TargetCurrentDevice,
ToOwner)`, which blocks until every remote write so far is visible to the device that owns the
memory. The receiver calls it for each NOTIFY (the sender's WRITEs of one layer have completed)
before the NOTIFY is acknowledged; the engine reads a request's blocks only after every NOTIFY of
its session was acknowledged. So the order is: WRITE completion, flush, acknowledgement, first read.

Whether a flush is needed is the device's own answer (`cudaDevAttrGPUDirectRDMAWritesOrdering`):
a device that orders GPUDirect writes for their owner needs none. A device that neither orders
them nor offers the flush (`cudaDevAttrGPUDirectRDMAFlushWritesOptions`) cannot take GPUDirect
safely: registration falls back to pinned staging (`rdma_memory.register`).

NOT EXERCISED with a NIC: no machine here has GPUDirect RDMA. The order is held by a contract
test on the emulated verbs device with a stand-in runtime; `tests/gpu` calls the real runtime.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

# CUDA runtime enums (driver_types.h)
ATTR_FLUSH_OPTIONS = 117  # cudaDevAttrGPUDirectRDMAFlushWritesOptions: a bitmask
ATTR_WRITES_ORDERING = 118  # cudaDevAttrGPUDirectRDMAWritesOrdering
FLUSH_OPTION_HOST = 1 << 0  # cudaFlushGPUDirectRDMAWritesOptionHost: the host-side flush exists
ORDERING_OWNER = 100  # cudaGPUDirectRDMAWritesOrderingOwner: the owner sees writes in order
TARGET_CURRENT_DEVICE = 0  # cudaFlushGPUDirectRDMAWritesTargetCurrentDevice
SCOPE_TO_OWNER = 100  # cudaFlushGPUDirectRDMAWritesToOwner
CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
"""Sonames tried in order; the one torch already loaded is found without searching the disk."""


class GpuDirectUnsupported(RuntimeError):
    """GPUDirect writes into this device could not be made visible safely: use staging."""


def load_cudart() -> Any:
    """The CUDA runtime library (ctypes); GpuDirectUnsupported when there is none."""
    for name in CUDART_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise GpuDirectUnsupported(f"no CUDA runtime library ({', '.join(CUDART_NAMES)})")


class WriteFlush:
    """The receiver's flush of GPUDirect writes into device `device_index` (see the module
    docstring). Calling it is a no-op on a device that orders such writes for their owner."""

    def __init__(self, device_index: int, cudart: Any = None) -> None:
        self.device = device_index
        self.cudart = cudart if cudart is not None else load_cudart()
        ordering = self._attribute(ATTR_WRITES_ORDERING)
        options = self._attribute(ATTR_FLUSH_OPTIONS)
        self.needed = ordering < ORDERING_OWNER
        """False when the device orders GPUDirect writes for their owner natively."""
        if self.needed and not options & FLUSH_OPTION_HOST:
            raise GpuDirectUnsupported(f"device {device_index} neither orders GPUDirect RDMA writes nor can flush them")
        self.flushes = 0
        """Flushes issued so far."""
        self._lock = threading.Lock()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise GpuDirectUnsupported(f"{what} failed (cudaError {rc})")

    def _attribute(self, attr: int) -> int:
        value = ctypes.c_int(0)
        rc = self.cudart.cudaDeviceGetAttribute(ctypes.byref(value), attr, self.device)
        self._check(rc, "cudaDeviceGetAttribute")
        return value.value

    def __call__(self) -> None:
        """Block until every GPUDirect write so far is visible to the device (when it needs that).
        Called on the receiver's connection threads: the device is made current in each."""
        if not self.needed:
            return
        with self._lock:
            self._check(self.cudart.cudaSetDevice(self.device), "cudaSetDevice")
            self._check(
                self.cudart.cudaDeviceFlushGPUDirectRDMAWrites(TARGET_CURRENT_DEVICE, SCOPE_TO_OWNER),
                "cudaDeviceFlushGPUDirectRDMAWrites",
            )
            self.flushes += 1
