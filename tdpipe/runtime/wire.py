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

import os
import pickle
from datetime import timedelta
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


DEFAULT_INIT_TIMEOUT_S = 300.0
"""How long rank 0 waits for every stage to join (and a stage for rank 0): process start and
`import torch` on a loaded machine, not model loading, which comes after the join."""
_store: dist.Store | None = None


class RendezvousTimeout(RuntimeError):
    """The ranks did not all meet within the init timeout (a pipeline failure: exit 1, not a bug)."""


def rendezvous_store() -> dist.Store:
    """The TCP store the group met through (rank 0 hosts it); stage heartbeats travel on it."""
    if _store is None:
        raise RuntimeError("init_process_group has not run")
    return _store


def init_process_group(device: str, timeout_s: float = DEFAULT_INIT_TIMEOUT_S) -> tuple[int, int]:
    """Join the group from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; returns (rank, world_size).

    Rank 0 hosts the store and waits at most `timeout_s` for every rank to connect; a stage waits
    as long for rank 0 (TimeoutError naming the rendezvous either way). CPU: gloo. CUDA: gloo for
    CPU tensors (control, tokens) and NCCL for CUDA tensors (hidden states); the CUDA path is not
    exercised on these machines.
    """
    global _store
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    try:
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=True,
        )
    except (RuntimeError, dist.DistStoreError) as e:  # DistStoreError: the timeout; RuntimeError: refused
        who = f"all {world - 1} stage ranks" if rank == 0 else "rank 0 (the controller)"
        raise RendezvousTimeout(f"{who} did not join at {where} within {timeout_s:g} s (--init-timeout): {e}") from None
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    _store = store
    return dist.get_rank(), dist.get_world_size()
