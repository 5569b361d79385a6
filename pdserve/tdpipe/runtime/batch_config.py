"""BatchConfig: one `pdserve batch` job's settings, frozen once they are resolved.

`pdserve batch`'s flags (`pdserve.commands.batch`, each field below is the flag of its name) are
read into this object once; `batch_main` then resolves what depends on the model and the device
(`resolved`) into a new frozen copy before any work starts. Nothing downstream writes settings
back: the job, the KV sizing and the stages read the same values for the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

FIXED_DEFAULT_BLOCKS = 512
"""KV blocks per stage without --num-kv-blocks or --kv-cache-memory on CUDA (stages are not profiled
for --gpu-memory-utilization: that sizing runs in the serving engine only) and with --external-stages
(whose `pdserve stage` ranks take the count as a flag and must agree with it); `batch_kv` sizes the
rest. Here, with the flags, so that their help states it without importing torch."""
DEFAULT_PREDICTED_LEN = 256
"""A chat answer's length when the job gives no hint (`batch_lengths`, `--length-predictor`'s help):
the order of vLLM's benchmark datasets' median."""
RESOLVED = ("sampling_defaults", "split_by_phase")
"""Fields that are no flag: batch_main derives them."""


@dataclass(frozen=True)
class BatchConfig:
    """A batch job's flags (see `pdserve batch --help` for each; their defaults live in the parser
    alone) and the values resolved from them."""

    input: str
    output: str
    model: str
    """A checkpoint directory (the built-in tiny model when the flag is unset)."""
    stages: int
    policy: str
    phase_split: str
    num_kv_blocks: int | None
    """The flag; after `resolved`, the per-stage block count the job runs with."""
    kv_cache_bytes: int | None
    generation_config: str | None
    block_size: int
    max_batch_tokens: int
    resume: bool
    stats: str | None
    external_stages: bool
    cost_table: str
    length_predictor: str | None
    profile_cache: str | None
    dtype: str
    num_threads: int
    init_timeout: float
    heartbeat_timeout: float
    tensor_parallel_size: int
    served_model_name: str | None
    max_lines_in_flight: int
    max_line_bytes: int
    output_order: str
    local_output_dir: str | None
    enable_metrics: bool
    metrics_host: str
    port: int
    # resolved by batch_main before the job starts
    sampling_defaults: dict[str, Any] | None = None
    """generation_config.json's sampling defaults (--generation-config), for fields a line leaves unset."""
    split_by_phase: bool = False
    """--phase-split resolved for this device and stage layout."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchConfig:
        """The job `pdserve batch`'s parsed flags describe (flags of other commands are ignored)."""
        flags = [f.name for f in dataclasses.fields(cls) if f.name not in RESOLVED]
        return cls(**{name: getattr(args, name) for name in flags})

    def resolved(self, **values: Any) -> BatchConfig:
        """A copy with `values` set (what batch_main derives from the model and the device)."""
        return dataclasses.replace(self, **values)
