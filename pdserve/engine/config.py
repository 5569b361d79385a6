"""EngineConfig: everything an LLMEngine is built from."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's (and torch's) other names of the dtypes: `--dtype half` means float16."""


class Preemption(enum.StrEnum):
    """What the scheduler does when the pool runs out (members equal their strings)."""

    RECOMPUTE = "recompute"
    """Free a running request's blocks and recompute it later (offline, colocated)."""
    NEVER = "never"
    """Admit only what can run to its end: KV is never dropped (decode nodes)."""


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance. Facts found at start-up (number of KV blocks, eos ids)
    live on the engine objects, never written back here."""

    model_dir: str | Path
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    tokenizer: str | Path | None = None
    """Directory of the tokenizer (tokenizer.json, tokenizer_config.json) when not the checkpoint's;
    on the command line also a Hub id already in the local HF cache (unset: the model's own)."""
    dtype: str = "auto"
    """auto (float32 on CPU, the checkpoint's dtype on GPU), float32 (alias float), bfloat16 or
    float16 (alias half)."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks, overriding the memory flags (unset: the pool is sized from them)."""
    kv_cache_bytes: int | None = None
    """KV pool size (`--kv-cache-memory`: e.g. 4GiB, 512MiB or bytes). Unset: on CPU a tenth of the
    host's available memory, at most what --max-num-seqs (at most 64) sequences of --max-model-len
    tokens fill; on CUDA profiled from --gpu-memory-utilization (see engine.kv_sizing)."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the share of the card this process may use; the KV pool gets what weights and the peak
    activations of a forward at the largest batch leave of it (as vLLM sizes it)."""
    max_num_seqs: int = 256
    """Most sequences in one step (vLLM's default). It bounds the logits of one step (max_num_seqs x
    vocab floats) and, on CPU, with max_model_len the default KV pool (at most 64 full-length sequences:
    engine.kv_sizing.CPU_KV_MAX_FULL_SEQS)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Longest prompt + output; refused at start when the KV pool cannot hold it (unset: the model's
    max_position_embeddings, lowered to what the pool holds)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached prompt prefixes."""
    preemption: str = Preemption.RECOMPUTE.value
    """recompute: under KV pressure free the newest request and recompute it later.
    never: a request's KV is never dropped; admission reserves blocks for prompt +
    max_tokens and is refused when they do not fit (the only choice on decode nodes)."""
    attention_backend: str = "auto"
    """torch (reference, any device), cpu_paged (C++ op reading KV pages in place; CPU), flashinfer
    (CUDA), or auto: cpu_paged on CPU; on CUDA torch where Triton imports (Triton decode kernel, CUDA
    graphs), else flashinfer when importable (and the KV dtype is float16 or bfloat16), else torch."""
    layer_range: tuple[int, int] | None = None
    """Load only these layers (pipeline stage); with tensor_parallel_size > 1 each rank loads its
    shard of them (a TD-Pipe stage that is a tensor-parallel group)."""
    seed: int = 0
    """Sampling seed of the engine."""
    num_threads: int | None = None
    """torch intra-op threads of this process (unset: torch's choice; with tensor parallelism on CPU,
    the host's cores shared out over the ranks)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (pdserve.engine.parallel), one process each, this one rank 0
    (gloo on CPU, NCCL on CUDA: rank r uses GPU index+r); must divide the attention heads and the
    MLP width."""
    dist_timeout: float = 120.0
    """Seconds one tensor-parallel collective may take before the group is declared broken (a rank
    hung): the node then reports NOT_SERVING and exits, and its supervisor restarts it (SGLang's
    `--dist-timeout`). Start-up (rendezvous, the agreement on the KV pool) has its own, longer bound."""
    enable_expert_parallel: bool = False
    """A mixture-of-experts model's experts are placed whole on the tensor-parallel ranks (a range
    each; the ranks must divide the number of experts) instead of each expert being split over all
    of them; attention stays split by heads (vLLM's `--enable-expert-parallel`)."""
    enforce_eager: bool = False
    """Run every step eager: no CUDA graphs for decode steps (vLLM's `--enforce-eager`). Unset, a
    CUDA engine captures its decode steps per batch-size bucket at start (pdserve.engine.cuda_graphs;
    their memory is part of --gpu-memory-utilization); CPU engines always run eager."""
    kv_offloading_bytes: int | None = None
    """Host memory for a KV tier below the pool (`--kv-offloading-size`: GiB as a plain number, as
    vLLM's, e.g. 8, or with a unit, e.g. 512MiB): finished requests' blocks are copied there and
    restored instead of recomputed once the pool has evicted them (pdserve.engine.kv_tier; unset: no
    tier)."""
    kv_store: str | None = None
    """A KV store shared by every node that mounts it, below the pool and the host tier:
    `file:///PATH`, optionally `?max=SIZE` (e.g. 64GiB; the least recently used blocks go beyond
    it), or `mooncake://MASTER_HOST:PORT` (a Mooncake Store; `pdserve up` also takes
    `mooncake://local` and starts a master of its own on loopback); a node looks there before
    recomputing a prefix another node computed (pdserve.engine.kv_shared_store; unset: none)."""
    rank_service: str = ""
    """"module:factory" of a side service every rank other than 0 runs (engine.parallel.rank_commands),
    e.g. a node's per-rank KV endpoint; empty: none."""

    def runner_options(self) -> dict:
        """ModelRunner's keyword arguments: every rank of a tensor-parallel engine builds its runner
        from the same ones."""
        return dict(
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.kv_cache_bytes,
            layer_range=self.layer_range,
            attention_backend=self.attention_backend,
            max_model_len=self.max_model_len,
            num_threads=self.num_threads,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            expert_parallel=self.enable_expert_parallel,
            enforce_eager=self.enforce_eager,
        )

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.preemption not in tuple(Preemption):
            raise ValueError(f"preemption must be 'recompute' or 'never', got {self.preemption!r}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be positive, got {self.dist_timeout}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_offloading_bytes is not None:
            if self.kv_offloading_bytes <= 0:
                raise ValueError(f"--kv-offloading-size must be positive, got {self.kv_offloading_bytes} bytes")
        if self.kv_store is not None:
            from pdserve.engine.kv_store_backends import parse_store_url

            parse_store_url(self.kv_store)  # ValueError naming --kv-store
