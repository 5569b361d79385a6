"""`python -m engine.parallel.worker`: one tensor-parallel rank other than 0.

Reads its spec (engine.parallel.launcher.rank_spec) as one JSON line on stdin, joins the group,
builds its ModelRunner shard and runs every batch rank 0 broadcasts until the stop step. It exits
when stdin reaches EOF (rank 0 is gone, by whatever signal) or when the group fails.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_tier_rank_service import RankTiers
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import RankFailure, TPGroup, rendezvous
from pdserve.engine.parallel.launcher import START_TIMEOUT_S, rank_options
from pdserve.engine.parallel.rank_commands import RankService


def _exit_with_rank0(service: RankService) -> None:
    """Serves rank 0's commands from stdin until EOF: rank 0 closed it (stop) or died; either way
    this rank is done."""
    service.serve(sys.stdin.buffer)
    os._exit(0)


def serve(spec: dict, service: RankService) -> None:
    """Join the group and run rank 0's steps until it says stop."""
    fields = dict(spec["config"])
    if fields.get("layer_range") is not None:
        fields["layer_range"] = tuple(fields["layer_range"])
    config = EngineConfig(**fields)
    rank = int(spec["rank"])
    store = rendezvous(rank, config.tensor_parallel_size, int(spec["port"]), START_TIMEOUT_S)
    options = rank_options(config, rank)
    tp = TPGroup(
        rank,
        config.tensor_parallel_size,
        store,
        torch.device(options["device"]),
        config.dist_timeout,
        start_timeout_s=START_TIMEOUT_S,
    )
    runner = ModelRunner(config.model_dir, **options, tp=tp)
    tiers = RankTiers(config, runner, rank) if config.kv_offloading_bytes or config.kv_store else None
    service.start(runner, tiers)
    connector = service.connector  # built by the service with this runner: its pool is registered
    while (msg := tp.recv_step()) is not None:
        batch = ForwardBatch(**msg["batch"])
        hidden = None
        if msg.get("hidden"):  # a later pipeline stage (tdpipe): rank 0 broadcasts the previous stage's output
            shape = (batch.num_tokens, runner.model_config.hidden_size)
            hidden = tp.broadcast(torch.empty(shape, dtype=runner.dtype, device=runner.device))
        runner.run(batch, hidden_states=hidden, connector=connector)


def main() -> int:
    spec = json.loads(sys.stdin.buffer.readline())
    service = RankService(spec["config"].get("rank_service", ""), spec.get("reply_fd"))
    threading.Thread(target=_exit_with_rank0, args=(service,), daemon=True, name="rank0-lifeline").start()
    try:
        serve(spec, service)
    except RankFailure as e:
        print(f"tensor-parallel rank {spec.get('rank')}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
