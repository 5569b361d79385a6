"""StageConfig: what one TD-Pipe pipeline stage is built from (`pdserve stage`'s flags, or the local
launcher of `pdserve batch`); apart from `stage_worker`, which imports torch, so that the CLI can
declare the stage's flags from these fields without it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_INIT_TIMEOUT_S = 300.0
"""How long rank 0 waits for every stage to join (and a stage for rank 0): process start and
`import torch` on a loaded machine, not model loading, which comes after the join."""


@dataclass(frozen=True)
class StageConfig:
    """What a stage needs besides its rank (which comes from the environment)."""

    model_dir: str
    """Checkpoint directory (every stage reads only its slice)."""
    num_kv_blocks: int
    """Blocks in this stage's KV pool; the controller allocates ids in [0, num_kv_blocks)."""
    block_size: int = 16
    """Tokens per KV block, as the controller's."""
    device: str = "cpu"
    """`cpu` or `cuda[:i]` (CUDA not exercised on these machines)."""
    dtype: str = "auto"
    """Weights and KV dtype: auto (float32 on CPU, the checkpoint's on GPU), float32, bfloat16 or float16."""
    num_threads: int = 1
    """torch threads of this stage."""
    attention_backend: str = "auto"
    """`torch`, `flashinfer` (CUDA) or `auto` (as the serving commands': `commands.device_args.resolve_backend`)."""
    init_timeout: float = DEFAULT_INIT_TIMEOUT_S
    """Seconds to wait for the other ranks at the rendezvous, rank 0 (the controller) at
    MASTER_ADDR:MASTER_PORT, before giving up."""
    tensor_parallel_size: int = 1
    """Ranks of this stage (engine.parallel): this process is rank 0, which alone talks to the
    controller and the neighbouring stages; it starts ranks 1..N-1 and drives them per batch."""
    phase_split: bool = False
    """Prefill batches on the equal layer split, decode steps on the head-weighted one
    (`stage_split.PipelineSplit`); local CPU stages of one tensor-parallel rank only."""
    kv_fd: int = -1
    """The launcher's shared KV file (`shared_kv`), which the phase split needs when it moves layers."""
