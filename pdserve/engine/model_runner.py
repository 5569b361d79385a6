"""ModelRunner: loads a checkpoint slice, owns the KV pool, runs one ForwardBatch."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from pdserve.engine.attention import AttentionMetadata, backend_for_planes, make_backend, resolve_backend
from pdserve.engine.cpu_malloc import keep_freed_memory
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, graphs_unsupported
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_connector import NO_CONNECTOR, KvConnector
from pdserve.engine.kv_pool import KVPool, kv_bytes_per_token
from pdserve.engine.kv_sizing import KvMemory, fit_max_model_len, kv_memory_for
from pdserve.engine.layers import can_prepack
from pdserve.engine.llama import LlamaModel
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TPGroup
from pdserve.engine.parallel.sharding import TPShard
from pdserve.engine.weights import load_tensors, resolve_dtype

log = logging.getLogger(__name__)


class ModelRunner:
    """The scheduler's only view of the model: `run(batch) -> logits`.

    With `layer_range`, only those layers are loaded (a pipeline stage); a
    non-last stage returns hidden states instead of logits and a non-first stage
    takes `hidden_states` instead of token ids. `fused_ops=False` keeps the eager
    elementwise ops even where the compiled CPU ops run (the A/B of benchmarks/profile_step.py);
    `prepack` holds the linear weights in oneDNN's layout (`engine.layers.Linear`; None: wherever
    it can).

    `run(batch, layers=(a, b))` runs a sub-range of the loaded layers (a pipeline stage whose layers
    depend on the batch's phase: tdpipe.runtime.stage_split.PipelineSplit); it embeds when `a` is 0 and
    returns logits when `b` is the model's last layer.

    The KV pool is `kv_tensor` when given (memory the caller allocated, e.g. shared with another
    stage), else sized after the weights load: `num_kv_blocks` exactly, else from `kv_memory`
    (default `kv_memory_for`: `kv_cache_bytes` or a share of the host's memory on CPU, a profiled
    `gpu_memory_utilization` share of the card on CUDA). `max_model_len` must fit the pool.

    With `tp` (engine.parallel), this is one tensor-parallel rank: it loads its shard of the
    weights, holds the KV of its heads only (`local_config`), all-reduces the attention and MLP
    outputs, and the ranks agree on one pool size. Every rank must `run` the same batches in the
    same order; rank 0 sends each batch to the others before running it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        layer_range: tuple[int, int] | None = None,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        num_threads: int | None = None,
        fused_ops: bool = True,
        prepack: bool | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_memory: KvMemory | None = None,
        tp: TPGroup | None = None,
        kv_tensor: torch.Tensor | None = None,
        expert_parallel: bool = False,
        enforce_eager: bool = False,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tp = tp
        self._drives_ranks = False
        """Rank 0 sends each batch to the other ranks. False until the pool is sized, so the start-up
        profile run (every rank runs the same one, engine.cuda_memory) sends nothing."""
        shard = TPShard(tp.rank, tp.size, expert_parallel) if tp is not None else None
        if shard is not None:
            shard.check(self.model_config)
        self.local_config = shard.local_config(self.model_config) if shard is not None else self.model_config
        """The geometry this process computes with: the whole model, or one rank's heads and MLP share."""
        cfg = self.local_config
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        start, end = layer_range or (0, cfg.num_hidden_layers)
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} outside the model's {cfg.num_hidden_layers} layers")
        self.layer_range = (start, end)
        self.block_size = block_size
        # provisional until the pool is sized: bounds the profiled batch and the default CPU budget
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if kv_tensor is not None:  # the caller's memory (a pipeline stage's shared KV) sets the count
            num_kv_blocks = kv_tensor.shape[1]
        if num_kv_blocks is None and kv_memory is None:
            kv_memory = kv_memory_for(
                self.device, kv_cache_bytes, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens
            )
        per_token = kv_bytes_per_token(cfg, end - start, self.dtype)
        if num_kv_blocks is None and kv_memory is not None and not kv_memory.needs_weights:
            num_kv_blocks = kv_memory.budget_bytes(self, per_token) // (per_token * block_size)
        if num_kv_blocks is not None:  # known before the weights load: refuse an impossible length at once
            fit_max_model_len(max_model_len, cfg.max_position_embeddings, num_kv_blocks, block_size)
        elif kv_memory is not None:
            kv_memory.before_load(self.device)
        tensors = load_tensors(model_dir, self.model_config, self.layer_range, self.dtype, self.device, shard)
        if prepack is None:
            prepack = can_prepack(self.dtype, self.device)
        all_reduce = tp.all_reduce if tp is not None else None
        self.model = LlamaModel(cfg, tensors, self.layer_range, self.device, fused_ops, prepack, all_reduce)
        backend = backend_for_planes(resolve_backend(attention_backend, self.device.type), cfg.kv_planes)
        self.attention = make_backend(backend)
        self.attention.configure(cfg.num_attention_heads, self.dtype, attention_sinks=cfg.attention_sinks)
        self.graphs: DecodeGraphs | None = None
        self._graph_sizes = None if enforce_eager else self._graph_sizes_for(max_num_seqs)
        if num_kv_blocks is None:  # profiled: measured with the weights in place
            assert kv_memory is not None
            num_kv_blocks = kv_memory.budget_bytes(self, per_token) // (per_token * block_size)
        if tp is not None:  # block ids are per node: every rank's pool has the same number of blocks
            num_kv_blocks = tp.agree_min(num_kv_blocks)
        self.kv_pool = KVPool(
            cfg, end - start, block_size, self.dtype, self.device, num_blocks=num_kv_blocks, tensor=kv_tensor
        )
        self.max_model_len = fit_max_model_len(
            max_model_len, cfg.max_position_embeddings, self.kv_pool.num_blocks, block_size
        )
        self._drives_ranks = tp is not None and tp.rank == 0
        if self._graph_sizes:
            self.graphs = self._captured_graphs(self._graph_sizes)

    def _graph_sizes_for(self, max_num_seqs: int) -> list[int] | None:
        """The decode batch sizes to capture, or None (eager) with the reason logged."""
        why = graphs_unsupported(self)
        if why is not None:
            if self.device.type == "cuda":
                log.info("CUDA graphs off: %s; decode steps run eager", why)
            return None
        return capture_sizes(max_num_seqs)

    def _captured_graphs(self, sizes: list[int]) -> DecodeGraphs | None:
        """Capture the decode graphs on the pool; a capture that fails (out of memory, an op that
        cannot be captured) leaves the runner eager, said in the log."""
        graphs = DecodeGraphs(self, sizes)
        try:
            graphs.capture_all()
        except Exception as e:  # torch.cuda.OutOfMemoryError among them
            log.warning("CUDA graphs off: capture failed (%s: %s); decode steps run eager", type(e).__name__, e)
            self._graph_sizes = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        return graphs

    def graph_memory_bytes(self) -> int:
        """Device memory the decode graphs will hold, measured by capturing them on the current
        (the sizing profile's scratch) pool and dropping them; 0 when there are none (then, too,
        when the trial capture failed: the runner will stay eager)."""
        if not self._graph_sizes:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs = self._captured_graphs(self._graph_sizes)
        if graphs is None:
            return 0
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        graphs.release()
        del graphs
        torch.cuda.empty_cache()
        return max(0, used)

    def check(self) -> None:
        """Raise if this runner can no longer step (pdserve.engine.parallel.launcher: a rank died)."""

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (their processes exit)."""
        if self._drives_ranks:
            assert self.tp is not None
            self._drives_ranks = False
            self.tp.send_step(None)

    @property
    def progress(self) -> int:
        """Decoder layers this process has computed since load (`LlamaModel.layers_run`)."""
        return self.model.layers_run

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last

    @torch.inference_mode()
    def run(
        self,
        batch: ForwardBatch,
        *,
        connector: KvConnector = NO_CONNECTOR,
        hidden_states: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """Through the model's last layer: logits [num_sampled, vocab] in the model's dtype (rows of sample_mask,
        in order), or with `head` False those rows' final hidden states [num_sampled, H] (`logits` later);
        else hidden [T, H]. `layers`: a sub-range of `layer_range` (default all of it)."""
        assert max(batch.context_lens) <= self.max_model_len, "context beyond max_model_len"
        if self.graphs is not None and layers is None and hidden_states is None:
            final = self._replay(batch, connector)
            if final is not None:
                return self.model.logits(final) if head else final
        start, end = layers or self.layer_range
        if not self.layer_range[0] <= start < end <= self.layer_range[1]:
            raise ValueError(f"layers {layers} outside this runner's {self.layer_range}")
        if (start, end) != self.layer_range and self.tp is not None:  # the other ranks get the batch, not the range
            raise ValueError("a tensor-parallel rank runs its whole layer range")
        if self._drives_ranks:
            assert self.tp is not None
            self.tp.send_step({"batch": dataclasses.asdict(batch), "hidden": hidden_states is not None})
            if hidden_states is not None:  # a later pipeline stage: only rank 0 got the previous stage's output
                self.tp.broadcast(hidden_states.contiguous())
        input_ids = None
        if start == 0:
            input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
            assert int(input_ids.min()) >= 0 and int(input_ids.max()) < self.model_config.vocab_size, (
                "token id out of range"
            )
        meta = AttentionMetadata.build(batch, self.kv_pool.block_size, self.device, self.model_config.sliding_window)
        connector.start_load(batch)
        hidden = self.model.forward(
            batch, input_ids, hidden_states, self.kv_pool, self.attention, meta, connector, (start, end)
        )
        connector.wait_for_save()
        if self.tp is not None:  # CUDA: a hung peer's collective fails here, in bounded time
            self.tp.synchronize()
        if end < self.model_config.num_hidden_layers:
            return hidden
        last_rows, end = [], 0
        for q_len, sample in zip(batch.query_lens, batch.sample_mask):
            end += q_len
            if sample:
                last_rows.append(end - 1)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        final = hidden.index_select(0, rows)
        return self.model.logits(final) if head else final

    def _replay(self, batch: ForwardBatch, connector: KvConnector) -> torch.Tensor | None:
        """A decode step from its CUDA graph: the sampled rows' final hidden states, or None when no
        graph fits (the caller runs it eager). The connector's per-layer hooks run around the whole
        replay: every restore lands before it, every save is announced after it."""
        assert self.graphs is not None
        if self.graphs.size_for(batch) is None:
            return None
        if max(batch.input_ids) >= self.model_config.vocab_size or min(batch.input_ids) < 0:
            raise AssertionError("token id out of range")
        start, end = self.layer_range
        connector.start_load(batch)
        for layer in range(start, end):
            connector.wait_for_layer(layer)
        hidden = self.graphs.replay(batch)
        assert hidden is not None
        for layer in range(start, end):
            connector.save_layer(layer, batch)
        connector.wait_for_save()
        if all(batch.sample_mask):
            return hidden
        rows = [i for i, sample in enumerate(batch.sample_mask) if sample]
        return hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states that `run(..., head=False)` returned: rows of several
        batches in one pass read the head's weights once (the head is whole on every rank)."""
        return self.model.logits(final_hidden)
