"""Point-to-point messages between the controller and the stages (torch.distributed).

Every send is asynchronous (`isend`) so no rank ever blocks on a peer that is
itself blocked sending: with rendezvous-style transports a blocking send from
the last stage (tokens) crossing a blocking send from the controller (the next
control message) would deadlock. Control messages are pickled into a uint8
tensor preceded by a one-element length tensor; they always travel on CPU, so
with the `cpu:gloo,cuda:nccl` backend they go over gloo while hidden states on
CUDA go over NCCL.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class Outbox:
    """Pending isends and the tensors they read from (kept alive until complete)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._pending.append((dist.isend(tensor, dst), tensor))
        # gloo marks a send complete only inside wait(), so completion cannot be polled:
        # wait for the oldest sends once many are pending (they left long ago).
        if len(self._pending) > 64:
            for work, _ in self._pending[:32]:
                work.wait()
            del self._pending[:32]

    def send_object(self, obj: object, dst: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([payload.numel()], dtype=torch.long), dst)
        self.send(payload, dst)

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def recv_object(src: int) -> object:
    """Blocking receive of one `Outbox.send_object` message."""
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src)
    return pickle.loads(payload.numpy().tobytes())


def init_process_group(device: str) -> tuple[int, int]:
    """Join the group from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; returns (rank, world_size).

    CPU: gloo. CUDA: gloo for CPU tensors (control, tokens) and NCCL for CUDA
    tensors (hidden states); the CUDA path is not exercised on these machines.
    """
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()
