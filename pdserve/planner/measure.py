"""A profile of the local model on this machine's cores, measured the way the batch job measures one.

For each thread count, `pdserve.tdpipe.runtime.profile.profiled_table` times the whole model as one
stage (`num_stages=1`): decode steps at the batch sizes the workload can form and prefill batches
of whole prompts of its token-weighted mean length, up to the batch token budget (`ProfilePlan`).
The result is a `Profile` of unit `core` whose degrees are the thread counts; `pdserve plan
--measure PATH` writes it as JSON for later `--profile PATH` runs.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.planner.config import SimConfig
from pdserve.planner.profile import Profile
from pdserve.planner.workload import Workload


def measure_profile(
    model_dir: str | Path, threads: list[int], workload: Workload, config: SimConfig, *, quick: bool = False
) -> Profile:
    """Time the model at each of `threads` (torch threads of one process) for this workload."""
    from pdserve.tdpipe.runtime.profile import plan_profile, profiled_table  # torch: only when measuring

    if not threads or min(threads) < 1:
        raise ValueError(f"thread counts must be >= 1, got {threads}")
    plan = plan_profile(
        [r.input_len for r in workload.requests],
        [r.output_len for r in workload.requests],
        kv_tokens=config.kv_tokens,
        num_stages=1,
        max_batch_tokens=config.max_batch_tokens,
        quick=quick,
    )
    name = Path(model_dir).name
    tables = {t: profiled_table(model_dir, 1, plan, name=f"{name}@{t}", num_threads=t) for t in sorted(set(threads))}
    return Profile(name, "cpu", "core", tables)
