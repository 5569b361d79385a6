"""Configuration of a simulated pipeline instance and of the TD-Pipe policies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def require_positive(config: object, *names: str) -> None:
    """Raise ValueError for the first of `config`'s fields `names` that is not > 0."""
    for name in names:
        if (value := getattr(config, name)) <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class InstanceConfig:
    """One pipeline-parallel instance and its batching limits."""

    num_stages: int = 4
    """Pipeline stages (devices)."""
    capacity_blocks: int = 11250
    """KV blocks of the instance (the default, 180k tokens, is about what 4x L20 (48 GB) hold for
    Llama-13B after weights at 0.9 memory utilisation)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_batch_tokens: int = 2048
    """Token budget of one prefill (or hybrid) batch."""
    max_num_seqs: int = 256
    """Per-batch request limit of the PP baselines (vLLM's default)."""

    def __post_init__(self) -> None:
        require_positive(self, "num_stages", "capacity_blocks", "block_size", "max_batch_tokens", "max_num_seqs")


@dataclass(frozen=True)
class TDPipeOptions:
    """Which TD-Pipe policies run (the ablations switch them one at a time)."""

    prefill_switch: Literal["greedy", "kv_threshold"] = "greedy"
    """prefill→decode: AI-based greedy prefill or a fixed KV-occupancy threshold."""
    kv_threshold: float = 0.7
    decode_switch: Literal["intensity", "completion"] = "intensity"
    """decode→prefill: spatial-temporal intensity or a fixed completion ratio."""
    completion_threshold: float = 0.5
    work_stealing: bool = True
    future_interval: int = 32
    future_horizon: int = 1024
    ref_batch_size: int = 256
    """Batch size whose per-request throughput counts as peak (spatial intensity)."""
    spatial_peak: Literal["phase", "fixed"] = "phase"
    """Peak of the spatial intensity: `phase` = the throughput at the decode phase's
    starting batch size, capped at `ref_batch_size` (what a switch can restore when
    the KV capacity caps the batch); `fixed` = at `ref_batch_size` always (the
    paper's literal definition, and this simulator's behaviour before the fix:
    it switched after a median 7% of a phase finished, see docs/tdpipe.md)."""
    size_prefill_batches: bool = True
    """Cap each prefill phase's batches where the cost table predicts the phase ends soonest
    (`td_scheduler.sized_prefill_batches`: the largest batch fills and drains the pipeline);
    False fills every batch to `max_batch_tokens`, as the paper does."""
    chunk_prefills: bool = True
    """Split a prompt across two prefill batches where it does not fit the rest of one, so every
    batch of a phase but its last is full (`td_scheduler.pack_prompts`) and the longest prompt no
    longer bounds the largest batch, which fills and drains the pipeline at every phase switch.
    False keeps prompts whole, as the paper does."""
    hold_first_tokens: bool = True
    """The last stage samples a prefill phase's first tokens together, with the phase's last batch
    (`Batch.hold`): the decode phase needs them all before it starts, and one pass of the LM head
    then reads its weights once a phase, not once a batch. The runtime's only (the simulator prices
    a batch the same either way); False samples each batch's as it ends."""
    temporal_refill: bool = True
    """Count the pipeline refill after the prefill phase in the temporal bubble
    (see `tdpipe.intensity.temporal_intensity`); False is the paper's bubble."""

    def __post_init__(self) -> None:
        if self.prefill_switch not in ("greedy", "kv_threshold"):
            raise ValueError(f"prefill_switch must be 'greedy' or 'kv_threshold', got {self.prefill_switch!r}")
        if self.decode_switch not in ("intensity", "completion"):
            raise ValueError(f"decode_switch must be 'intensity' or 'completion', got {self.decode_switch!r}")
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if not 0.0 < self.completion_threshold <= 1.0:
            raise ValueError(f"completion_threshold must be in (0, 1], got {self.completion_threshold}")
        if self.spatial_peak not in ("phase", "fixed"):
            raise ValueError(f"spatial_peak must be 'phase' or 'fixed', got {self.spatial_peak!r}")
        require_positive(self, "ref_batch_size")
