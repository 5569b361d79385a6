"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket (as vLLM and SGLang do).

Why: a decode step of a small batch is a few hundred small kernels. Eager, the GPU waits on
Python to launch each of them, so the step's time is the launch loop's, not the weights' read
from memory. A graph launches the whole forward at once.

How:
- At start, after the KV pool is allocated, the whole forward of a decode step (embedding to final
  norm, no LM head) is captured once for each size in `capture_sizes` (largest first, all in one
  memory pool), reading its inputs from fixed device buffers: token ids, positions, KV slots, a
  fixed-width block table and context lengths (the attention reads pages in place:
  `attention.triton_decode`).
- A decode-only step of S <= the largest size fills the first S rows of those buffers and replays
  the smallest graph of at least S rows. The padding rows repeat row 0 (its token, position, slot
  and table), so they write row 0's K/V to row 0's slot again, the same values, and touch no other
  block. The capture itself (buffers zeroed) writes into block 0 of the pool, once, at start,
  before any request holds a block.
- Everything else runs eager: prefill and mixed steps, larger batches, pipeline stages, tensor
  parallelism, MLA and mixture-of-experts models (data-dependent routing has no fixed shape), the
  flashinfer backend (its plan is per step), and `--enforce-eager`.
- Memory: the graphs' pool is measured by a trial capture while the KV pool is sized
  (`engine.cuda_memory`), so it comes out of `--gpu-memory-utilization`, not on top of it. A
  capture that fails (out of memory, an op that cannot be captured) is logged and the runner stays
  eager.

The capture runs only on CUDA; `GraphCapture` is the seam that lets the CPU tests replay the same
static-buffer forward (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.block_manager import blocks_for
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_connector import NO_CONNECTOR

if TYPE_CHECKING:
    from pdserve.engine.attention import AttentionBackend
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.llama import LlamaModel
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.parallel.group import TPGroup

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Batch sizes captured (those up to --max-num-seqs): every size up to 4, then steps of 8, 16 and
32, so that a step pads at most 8 rows up to 64 sequences and at most 32 beyond. Larger batches
run eager: their launches are a small share of a step that reads that much KV."""


class GraphedRunner(Protocol):
    """The model runner as the graphs see it (a Protocol: engine.model_runner imports this module)."""

    device: torch.device
    block_size: int
    max_model_len: int
    model_config: ModelConfig
    model: LlamaModel
    kv_pool: KVPool
    attention: AttentionBackend
    tp: TPGroup | None
    layer_range: tuple[int, int]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The sizes captured for an engine of `max_num_seqs`: CAPTURE_SIZES up to it, and it itself
    when it falls between two of them."""
    sizes = [n for n in CAPTURE_SIZES if n <= max_num_seqs]
    if max_num_seqs < CAPTURE_SIZES[-1] and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class Replay(Protocol):
    """A captured forward: calling it reruns the captured work on the current buffer contents."""

    def __call__(self) -> None: ...


class GraphCapture(Protocol):
    """Captures `forward` (which reads and writes only fixed tensors) into something replayable;
    the returned tensor is the forward's output, refreshed by each replay."""

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]: ...


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph` capture, every graph in one shared memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        # warm up on a side stream first (cuBLAS workspaces, Triton's compile), as torch's docs ask
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.graphs.append(graph)
        return graph.replay, out


class DecodeGraphs:
    """The decode graphs of one ModelRunner, and the fixed buffers they read.

    `replay(batch)` returns the final hidden states [S, H] of a decode-only batch (the LM head runs
    after, eager, on the sampled rows), or None when no graph fits it (then the caller runs eager).
    """

    def __init__(self, runner: GraphedRunner, sizes: list[int], capture: GraphCapture | None = None) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self._capture = capture
        """How a forward is captured: CUDA graphs unless a caller (a CPU test) gives another."""
        self._cuda_capture: CudaGraphCapture | None = None
        dev = runner.device
        n = self.max_size
        self.max_pages = blocks_for(runner.max_model_len, runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_blocks = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(n, dtype=torch.long, device=dev)
        self.table = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        pinned = dev.type == "cuda"
        self._host_rows = torch.zeros(5, n, dtype=torch.long, pin_memory=pinned)
        """ids, positions, blocks, offsets, context lengths of a step, staged for one copy."""
        self._host_table = torch.zeros(n, self.max_pages, dtype=torch.int32, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None
        """Recorded after a step's copies leave the pinned buffers: the next step waits on it before
        writing them (the copies are asynchronous)."""
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.replays = 0
        """Steps served from a graph (tests and logs)."""

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture_all(self) -> None:
        """Capture every size on the runner's current KV pool, largest first (the shared pool is
        sized by the first); raises what the capture raised, with nothing kept."""
        capture = self._capture
        if capture is None:
            capture = self._cuda_capture = CudaGraphCapture(self.runner.device)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for n in sorted(self.sizes, reverse=True):
                    self._graphs[n] = capture(functools.partial(self._forward, n))
        except BaseException:
            self.release()
            raise
        log.info(
            "CUDA graphs: %d decode batch sizes captured in %.1f s", len(self._graphs), time.perf_counter() - started
        )

    def release(self) -> None:
        """Drop the graphs (and, once collected, their memory pool)."""
        self._graphs.clear()
        self._cuda_capture = None

    def _forward(self, n: int) -> torch.Tensor:
        """The captured work for `n` rows: the forward over the first n rows of the buffers."""
        runner = self.runner
        cfg = runner.model_config
        batch = ForwardBatch(  # only its shape is read (decode-only); the tensors below carry the step
            request_ids=[""] * n,
            input_ids=[0] * n,
            query_lens=[1] * n,
            context_lens=[1] * n,
            block_tables=[[0]] * n,
            sample_mask=[True] * n,
        )
        meta = AttentionMetadata(
            batch,
            runner.block_size,
            self.slot_blocks[:n],
            self.slot_offsets[:n],
            self.positions[:n],
            cfg.sliding_window,
            decode_table=self.table[:n],
            decode_ctx=self.ctx[:n],
        )
        runner.model.layers_run -= runner.model.end - runner.model.start  # the capture computes nothing
        return runner.model.forward(
            batch, self.input_ids[:n], None, runner.kv_pool, runner.attention, meta, NO_CONNECTOR
        )

    def size_for(self, batch: ForwardBatch) -> int | None:
        """The captured size a batch replays in (None: none fits, run eager)."""
        if not self._graphs or not batch.is_decode_only or batch.num_seqs > self.max_size:
            return None
        return next(n for n in self.sizes if n >= batch.num_seqs)

    def replay(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run a decode-only batch from its graph: final hidden states [S, H], or None (eager)."""
        n = self.size_for(batch)
        if n is None:
            return None
        s, bs = batch.num_seqs, self.runner.block_size
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host_rows
        ctx = batch.context_lens
        pos = [c - 1 for c in ctx]
        rows[0, :s] = torch.tensor(batch.input_ids)
        rows[1, :s] = torch.tensor(pos)
        rows[2, :s] = torch.tensor([t[p // bs] for t, p in zip(batch.block_tables, pos)])
        rows[3, :s] = torch.tensor([p % bs for p in pos])
        rows[4, :s] = torch.tensor(ctx)
        rows[:, s:n] = rows[:, :1]  # padding rows repeat row 0
        widths = [blocks_for(c, bs) for c in ctx]
        width = max(widths)
        table = self._host_table
        table[:s, :width] = torch.tensor([t[:w] + [0] * (width - w) for t, w in zip(batch.block_tables, widths)])
        table[s:n, :width] = table[:1, :width]
        blocking = not rows.is_pinned()
        for dst, src in zip((self.input_ids, self.positions, self.slot_blocks, self.slot_offsets), rows[:4]):
            dst[:n].copy_(src[:n], non_blocking=not blocking)
        self.ctx[:n].copy_(rows[4, :n], non_blocking=not blocking)
        self.table[:n, :width].copy_(table[:n, :width], non_blocking=not blocking)
        if not blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()
        run, out = self._graphs[n]
        run()
        self.replays += 1
        self.runner.model.layers_run += self.runner.model.end - self.runner.model.start
        return out[:s]


def graphs_unsupported(runner: GraphedRunner) -> str | None:
    """Why `runner` cannot replay decode graphs (None: it can). Checked once, at start."""
    from pdserve.engine.attention.torch_backend import TorchAttention

    cfg = runner.model_config
    if runner.device.type != "cuda":
        return "not on CUDA"
    if runner.tp is not None:
        return "tensor parallelism (its collectives run eager)"
    if runner.layer_range != (0, cfg.num_hidden_layers):
        return "a pipeline stage"
    if cfg.mla is not None:
        return "MLA attention"
    if any(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)):
        return "a mixture-of-experts model (its expert routing has no fixed shape)"
    if not isinstance(runner.attention, TorchAttention):
        return "the flashinfer backend (its plan is made per step)"
    return None
