"""KV blocks per `pdserve batch` stage, sized as the engine sizes its pool (`engine.kv_sizing`).

The controller allocates block ids for every stage, so it decides the count before the stages
start: `--num-kv-blocks` exactly, else `--kv-cache-memory` per stage, else on CPU a share of the
host's available memory split among the local stages (and never more than the job's lines could
fill). The block count is one for all stages, set by the stage with the most layers (the split
weighs the LM head the last stage runs, so that is usually the first: `stage_split`; under the
phase split a stage holds the layers of both of its ranges, and the shared ones count once in
host memory but in full here).
"""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.engine.kv_pool import kv_bytes_per_token
from pdserve.engine.kv_sizing import available_memory_bytes, default_cpu_kv_bytes
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.weights import resolve_dtype
from pdserve.tdpipe.runtime.batch_config import FIXED_DEFAULT_BLOCKS
from pdserve.tdpipe.runtime.stage_split import pipeline_split


class StageKvFlags(Protocol):
    """The flags the block count depends on (a BatchConfig; `pdserve stage` derives the same)."""

    @property
    def num_kv_blocks(self) -> int | None: ...

    @property
    def kv_cache_bytes(self) -> int | None: ...

    @property
    def external_stages(self) -> bool: ...

    @property
    def dtype(self) -> str: ...

    @property
    def stages(self) -> int: ...

    @property
    def split_by_phase(self) -> bool: ...

    @property
    def block_size(self) -> int: ...


def stage_kv_blocks(
    args: StageKvFlags, cfg: ModelConfig, device: str, num_lines: int, available: int | None = None
) -> int:
    """The per-stage block count for this job (ValueError when the budget holds under two blocks)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_bytes is None and (device.startswith("cuda") or args.external_stages):
        return FIXED_DEFAULT_BLOCKS
    dtype = resolve_dtype(args.dtype, cfg, torch.device(device))
    split = pipeline_split(cfg, args.stages, args.split_by_phase)
    most_layers = max(end - start for start, end in map(split.held, range(args.stages)))
    per_token = kv_bytes_per_token(cfg, most_layers, dtype)
    budget = args.kv_cache_bytes
    if budget is None:
        # every local stage takes its pool from the same host
        host = (available if available is not None else available_memory_bytes()) // args.stages
        budget = default_cpu_kv_bytes(per_token, max(num_lines, 1), cfg.max_position_embeddings, host)
    blocks = budget // (per_token * args.block_size)
    if blocks < 2:
        raise ValueError(
            f"--kv-cache-memory {budget} bytes holds {blocks} KV blocks per stage (a block of "
            f"{args.block_size} tokens takes {per_token * args.block_size} bytes): raise it"
        )
    return blocks
