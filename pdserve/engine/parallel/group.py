"""TPGroup: one rank's handle on its tensor-parallel group (torch.distributed process groups).

Two groups over one TCPStore: a gloo group for control (the step broadcast from rank 0, the
start-up agreement on the KV pool size) and a device group for the activations' all-reduce
(gloo on CPU; NCCL on CUDA, the path vLLM takes: written for CUDA but not run on this CPU-only
machine). The groups are built directly, not through `init_process_group`, so a process may hold
several (tests run TP=1 and TP=2 engines side by side) and nothing global is left behind.

Failure model: a rank that dies closes its sockets, and gloo fails every pending collective of
the others at once ("Connection closed by peer"); a rank that hangs fails the others after
`timeout` (EngineConfig.dist_timeout). Waiting for the next step is the one wait without that
bound (an idle node sends no steps), so it takes `idle_timeout`; rank 0's death still ends it at
once. Start-up (the KV pool agreement after each rank loaded its weights) takes `start_timeout`.

On NCCL, `work.wait()` does not block the host: it only orders the current stream after the
collective, so neither a hang nor the collective's time is seen there. Instead each all-reduce
is bracketed by CUDA events, and `synchronize` (after every forward) waits for the last one with
the same `timeout`, polling, so a hung peer becomes a RankFailure in bounded time and the events
give the collectives' time. NCCL's own watchdog, with async error handling on
(TORCH_NCCL_ASYNC_ERROR_HANDLING=1: tear down), is the last resort at twice that: it ends the
process on a communicator error or a collective stuck past it, so a step never completes with
the garbage an aborted collective leaves.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STEP_CAPACITY = 64 * 1024
"""Bytes of one step broadcast; a larger step (a huge batch) sends its tail in a second one."""
_HEADER = 8


class RankFailure(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died or hung. The group is broken."""


def rendezvous(rank: int, size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The group's store on 127.0.0.1: rank 0 hosts it (`port` 0: any free one, see `.port`)."""
    return dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class TPGroup:
    """Rank `rank` of `size` over `store` (see `rendezvous`); blocks until every rank has joined.
    `timeout_s`: the bound of every collective (a hung rank); `start_timeout_s`: of the start-up
    agreement."""

    def __init__(
        self,
        rank: int,
        size: int,
        store: dist.Store,
        device: torch.device,
        timeout_s: float = 120.0,
        idle_timeout_s: float = 7 * 24 * 3600.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.idle_timeout = timedelta(seconds=idle_timeout_s)
        self.start_timeout = timedelta(seconds=start_timeout_s)
        self.store = store
        # Any: torch's stubs lack the Backend collectives (allreduce, broadcast) these objects have.
        # Joined within the start-up bound (ranks start at different times); every collective below
        # names its own timeout.
        self.ctl: Any = dist.ProcessGroupGloo(dist.PrefixStore("ctl", self.store), rank, size, self.start_timeout)
        self._events: list[tuple[Any, Any]] | None = None
        """CUDA: (start, end) events of the all-reduces issued since the last `synchronize`."""
        if device.type == "cuda":  # written for CUDA, not run here (no GPU on the CI machine)
            torch.cuda.set_device(device)  # NCCL binds each rank to the current device: its own card
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # read when the group is built
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = 2 * self.timeout  # the watchdog's last resort; `synchronize` fires first
            self.dev: Any = dist.ProcessGroupNCCL(dist.PrefixStore("dev", self.store), rank, size, opts)
            self._events = []
        else:
            self.dev = self.ctl
        self._sum = _reduce_options(dist.ReduceOp.SUM, self.timeout)
        self._buf = torch.empty(STEP_CAPACITY, dtype=torch.uint8)
        self.all_reduce_seconds = 0.0
        """Time this rank spent in all-reduces (benchmarks/tp_scaling.py reads it); on CUDA counted
        from events at each `synchronize`."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self._events is None:  # gloo: the wait blocks, and raises after `timeout`
            t0 = time.perf_counter()
            _wait(self.dev.allreduce([t], self._sum))
            self.all_reduce_seconds += time.perf_counter() - t0
            return t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _wait(self.dev.allreduce([t], self._sum))  # NCCL: the current stream waits, not the host
        end.record()
        self._events.append((start, end))
        return t

    def synchronize(self, poll_s: float = 50e-6) -> None:
        """After a forward: wait until this rank's collectives have completed, at most `timeout`
        (RankFailure: a peer hung), then count their time. Nothing to wait for on gloo, whose
        collectives are done when they return."""
        if not self._events:
            return
        last = self._events[-1][1]
        deadline = time.monotonic() + self.timeout_s
        while not last.query():
            if time.monotonic() > deadline:
                raise RankFailure(f"a tensor-parallel collective did not complete within {self.timeout_s:g} s")
            time.sleep(poll_s)
        self.all_reduce_seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
        self._events.clear()

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype), on the device group: a pipeline
        stage's incoming hidden states, which only its rank 0 receives from the previous stage."""
        _wait(self.dev.broadcast(t, 0, self.timeout))
        return t

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (every rank gets it)."""
        t = torch.tensor([value], dtype=torch.int64)
        _wait(self.ctl.allreduce([t], _reduce_options(dist.ReduceOp.MIN, self.start_timeout)))
        return int(t.item())

    def send_step(self, msg: dict | None) -> None:
        """Rank 0: broadcast one step's work (None: stop) to the other ranks, as JSON (never pickle:
        the ranks' sockets are reachable by other local processes)."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        head = len(data).to_bytes(_HEADER, "little") + data[: STEP_CAPACITY - _HEADER]
        self._buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        _wait(self.ctl.broadcast(self._buf, 0, self.timeout))
        if len(data) > STEP_CAPACITY - _HEADER:
            tail = torch.frombuffer(bytearray(data[STEP_CAPACITY - _HEADER :]), dtype=torch.uint8)
            _wait(self.ctl.broadcast(tail, 0, self.timeout))

    def recv_step(self) -> dict | None:
        """Other ranks: wait (idle_timeout) for rank 0's next step."""
        _wait(self.ctl.broadcast(self._buf, 0, self.idle_timeout))
        n = int.from_bytes(self._buf[:_HEADER].numpy().tobytes(), "little")
        first = self._buf[_HEADER : _HEADER + min(n, STEP_CAPACITY - _HEADER)].numpy().tobytes()
        if n <= STEP_CAPACITY - _HEADER:
            return json.loads(first)
        tail = torch.empty(n - len(first), dtype=torch.uint8)
        _wait(self.ctl.broadcast(tail, 0, self.timeout))
        return json.loads(first + tail.numpy().tobytes())


def _reduce_options(op: Any, timeout: timedelta) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = timeout
    return opts


def _wait(work: dist.Work) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo / NCCL: a peer closed its connection or the timeout passed
        raise RankFailure(f"tensor-parallel group failed: {e}") from e
