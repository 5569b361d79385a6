"""Point-to-point messages between the controller and the stages (torch.distributed).

Every send is asynchronous (`isend`) so no rank ever blocks on a peer that is
itself blocked sending: with rendezvous-style transports a blocking send from
the last stage (tokens) crossing a blocking send from the controller (the next
control message) would deadlock. Control messages are pickled into a uint8
tensor; they always travel on CPU, so with the `cpu:gloo,cuda:nccl` backend they
go over gloo while hidden states on CUDA go over NCCL.

gloo moves a message only once its receiver has posted the receive: a send
waits for the peer's "ready" notice, and answering it wakes the sender's event
loop. For the per-batch control message that round trip fell on the pipeline's
critical path (a first stage waiting ~3 ms per decode step for a message sent
long before; docs/benchmark-log.md, "Control frames"). So the controller -> stage
channel sends fixed-size frames (`send_frame`) into a receive the stage posts
ahead of time (`ControlInbox`): the message lands while the stage computes.
The stages' timelines at shutdown travel in the same frames (`recv_frame`, with
nothing posted ahead).
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from pdserve.tdpipe.runtime.stage_config import DEFAULT_INIT_TIMEOUT_S


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

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


CONTROL_FRAME_BYTES = 16 * 1024
"""One control frame: an 8-byte payload length, then the pickled message. A decode batch of 64
sequences at 1024 tokens of context (13.5 KB) and a 2048-token prefill batch (~5 KB) fit; a longer
message overflows into a second one. Larger frames are slower: on loopback, frames of 48 KiB and up
took 1-12 ms to arrive (16-32 KiB: ~0.6 ms)."""
_LENGTH_BYTES = 8
_ROOM = CONTROL_FRAME_BYTES - _LENGTH_BYTES
"""Payload bytes in the frame; the rest of a longer message follows as the overflow."""
MAX_CONTROL_MESSAGE_BYTES = 1 << 30
"""A control message's size limit (a batch of a million tokens pickles to a few MB)."""


def control_frames(obj: object) -> list[torch.Tensor]:
    """The tensors `send_frame` sends for `obj`: one frame, plus the overflow when it does not fit."""
    data = pickle.dumps(obj)
    frame = bytearray(CONTROL_FRAME_BYTES)
    frame[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
    head, rest = data[:_ROOM], data[_ROOM:]
    frame[_LENGTH_BYTES : _LENGTH_BYTES + len(head)] = head
    tensors = [torch.frombuffer(frame, dtype=torch.uint8)]
    return tensors if not rest else [*tensors, torch.frombuffer(bytearray(rest), dtype=torch.uint8)]


def send_frame(outbox: Outbox, obj: object, dsts: Iterable[int]) -> None:
    """Send `obj` to the `ControlInbox` of every rank in `dsts` (module docstring), pickled once."""
    frames = control_frames(obj)
    for dst in dsts:
        for tensor in frames:
            outbox.send(tensor, dst)


def _unframe(frame: torch.Tensor, src: int, irecv: Callable[[torch.Tensor], Any]) -> object:
    """The message whose first frame is `frame`, receiving its overflow from `src` with `irecv`."""
    size = int.from_bytes(frame[:_LENGTH_BYTES].numpy().tobytes(), "little")
    if size > MAX_CONTROL_MESSAGE_BYTES:  # not a frame of ours: refuse it before allocating for it
        raise RuntimeError(f"control frame from rank {src} claims {size} bytes (limit {MAX_CONTROL_MESSAGE_BYTES})")
    data = frame[_LENGTH_BYTES : _LENGTH_BYTES + min(size, _ROOM)].numpy().tobytes()
    if size > _ROOM:  # the overflow is the next message from src
        rest = torch.empty(size - _ROOM, dtype=torch.uint8)
        irecv(rest).wait()
        data += rest.numpy().tobytes()
    return pickle.loads(data)


class ControlInbox:
    """A stage's end of the controller's `send_frame` channel: the receive of the next frame is
    posted as soon as the previous message is read, so the controller's send completes at once and
    the message is here before the stage asks for it. `irecv(tensor)` posts a receive from `src`:
    torch.distributed's `irecv` by default; the profile passes its process group's."""

    def __init__(self, src: int, irecv: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.src = src
        self._irecv: Callable[[torch.Tensor], Any] = irecv or (lambda t: dist.irecv(t, src))
        self._frame = torch.empty(CONTROL_FRAME_BYTES, dtype=torch.uint8)
        self._work: Any = self._irecv(self._frame)

    def recv(self) -> object:
        """The next message (blocking). After the controller's None (shutdown) nothing stays
        posted, so the process group can close."""
        if self._work is None:
            raise RuntimeError("the control channel is closed (its last message was None)")
        self._work.wait()
        # the overflow, if any, is received before the next frame's receive is posted: gloo matches
        # receives from one rank in the order they were posted
        obj = _unframe(self._frame, self.src, self._irecv)
        self._work = None if obj is None else self._irecv(self._frame)
        return obj


def recv_frame(src: int) -> object:
    """Blocking receive of one `send_frame` message from `src`, with no receive posted ahead."""
    frame = torch.empty(CONTROL_FRAME_BYTES, dtype=torch.uint8)
    dist.recv(frame, src)
    return _unframe(frame, src, lambda t: dist.irecv(t, src))


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
