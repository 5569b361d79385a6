"""Host staging for a device (CUDA) pool: one pinned buffer per connection, allocated once and reused.

A socket can only read and write host memory, so with a CUDA pool the TCP sender copies each
run device-to-host into its staging buffer before `sendall`, and the receiver lands each payload
in its staging buffer before one host-to-device copy. The copies run on a side CUDA stream that
first waits on the layer's ready event, so the sender never reads a layer before its kernels are
done and never queues behind the engine's later layers on the default stream.

CUDA is exercised only on a GPU machine (tests marked `gpu`); on CPU the same code runs with a
regular (unpinned) buffer for a pool that reports itself as device memory, which is how the
regression tests drive it.
"""

from __future__ import annotations

import torch


class HostStaging:
    """A reusable host buffer plus the copies between it and a device-resident pool tensor."""

    def __init__(self, capacity: int = 0, buffer: torch.Tensor | None = None) -> None:
        self._buf: torch.Tensor | None = buffer
        self._fixed = buffer is not None
        """A caller-owned buffer (e.g. registered for RDMA): never re-allocated, frames must fit."""
        self._stream: torch.cuda.Stream | None = None
        self.allocations = 0
        """How many times the buffer was (re)allocated: stays 1 while frames fit (tests read it)."""
        if capacity and not self._fixed:
            self._ensure(capacity)

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self._fixed:
            assert self._buf is not None
            if nbytes > self._buf.numel():
                raise ValueError(f"{nbytes} bytes do not fit the fixed staging buffer of {self._buf.numel()}")
            return self._buf
        if self._buf is None or self._buf.numel() < nbytes:
            # grow geometrically so a slowly growing run size does not re-pin on every frame
            size = max(nbytes, 2 * self._buf.numel() if self._buf is not None else 0)
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self.allocations += 1
        return self._buf

    def _side_stream(self, tensor: torch.Tensor):
        if not tensor.is_cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        return self._stream

    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(torch.uint8).view(-1)

    def read(self, tensor: torch.Tensor, start: int, nbytes: int, ready_event=None) -> memoryview:
        """Copy pool bytes [start, start+nbytes) to host, after `ready_event`; a view valid until the next call."""
        return self.gather(tensor, [(start, nbytes)], ready_event)

    def gather(self, tensor: torch.Tensor, spans: list[tuple[int, int]], ready_event=None) -> memoryview:
        """Copy each pool span (start, nbytes), back to back, to host after `ready_event` (one sync)."""
        total = sum(n for _, n in spans)
        buf, flat = self._ensure(total), self._flat(tensor)
        stream = self._side_stream(tensor)
        if stream is None:
            self._copy_out(buf, flat, spans, False)
        else:
            with torch.cuda.stream(stream):
                if ready_event is not None:
                    stream.wait_event(ready_event)  # GPU-side wait: the layer's KV writes come first
                self._copy_out(buf, flat, spans, True)
            stream.synchronize()
        return buf[:total].numpy().data

    @staticmethod
    def _copy_out(buf: torch.Tensor, flat: torch.Tensor, spans: list[tuple[int, int]], non_blocking: bool) -> None:
        at = 0
        for start, n in spans:
            buf[at : at + n].copy_(flat[start : start + n], non_blocking=non_blocking)
            at += n

    def landing(self, nbytes: int) -> memoryview:
        """A host view of `nbytes` to receive a payload into (then `scatter` it)."""
        return self._ensure(nbytes)[:nbytes].numpy().data

    def commit(self, tensor: torch.Tensor, start: int, nbytes: int) -> None:
        """Copy the landed `nbytes` into pool bytes [start, start+nbytes)."""
        self.scatter(tensor, [(start, nbytes)])

    def scatter(self, tensor: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """Copy the landed bytes, back to back, into each pool span; returns once the copies are done."""
        flat, stream = self._flat(tensor), self._side_stream(tensor)
        assert self._buf is not None, "scatter follows landing()"
        ctx = torch.cuda.stream(stream) if stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            at = 0
            for start, n in spans:
                flat[start : start + n].copy_(self._buf[at : at + n], non_blocking=stream is not None)
                at += n
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if stream is not None:
            stream.synchronize()  # the buffer is reused by the next frame; the ack must follow the copy
