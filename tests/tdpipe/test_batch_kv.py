"""`pdserve batch` sizes each stage's KV pool as the engine does: --num-kv-blocks, --kv-cache-memory
per stage, or a share of the host's memory split among the local stages."""

from __future__ import annotations

from argparse import Namespace

import pytest

from pdserve.cli import build_parser
from pdserve.engine.model_config import ModelConfig
from pdserve.tdpipe.runtime.batch_config import BatchConfig
from pdserve.tdpipe.runtime.batch_kv import FIXED_DEFAULT_BLOCKS, stage_kv_blocks
from pdserve.tdpipe.runtime.stage_split import model_stage_ranges

MiB = 1024**2


def _args(**kw) -> Namespace:
    base = dict(
        num_kv_blocks=None,
        kv_cache_bytes=None,
        stages=2,
        block_size=16,
        dtype="float32",
        external_stages=False,
        split_by_phase=False,
    )
    return Namespace(**{**base, **kw})


def test_kv_cache_memory_sets_the_stage_block_count(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)  # 4 layers: 2 + 2 (its head costs under half a layer)
    per_layer_block = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 16  # float32 K and V of 16 tokens
    assert model_stage_ranges(cfg, 2) == [(0, 2), (2, 4)]
    per_block = 2 * per_layer_block  # the stage with the most layers sets the count for all
    assert stage_kv_blocks(_args(kv_cache_bytes=MiB), cfg, "cpu", 10) == MiB // per_block
    assert stage_kv_blocks(_args(kv_cache_bytes=4 * MiB), cfg, "cpu", 10) == 4 * MiB // per_block
    # three stages of 2, 1, 1 layers: the largest decides
    assert model_stage_ranges(cfg, 3) == [(0, 2), (2, 3), (3, 4)]
    assert stage_kv_blocks(_args(kv_cache_bytes=MiB, stages=3), cfg, "cpu", 10) == MiB // (2 * per_layer_block)
    assert stage_kv_blocks(_args(num_kv_blocks=7, kv_cache_bytes=MiB), cfg, "cpu", 10) == 7
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        stage_kv_blocks(_args(kv_cache_bytes=1000), cfg, "cpu", 10)


def test_default_is_a_host_share_split_among_stages_and_capped_by_the_job(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    per_block = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 2 * 16  # 2 layers per stage
    # 2000 MiB available, 2 stages: a tenth of 1000 MiB each (the job's 1000 lines could fill more)
    assert stage_kv_blocks(_args(), cfg, "cpu", 1000, available=2000 * MiB) == 100 * MiB // per_block
    # 3 lines of at most max_position_embeddings tokens each
    assert stage_kv_blocks(_args(), cfg, "cpu", 3, available=800 * MiB) == 3 * cfg.max_position_embeddings // 16
    assert stage_kv_blocks(_args(), cfg, "cuda", 3) == FIXED_DEFAULT_BLOCKS
    assert stage_kv_blocks(_args(external_stages=True), cfg, "cpu", 3) == FIXED_DEFAULT_BLOCKS


def test_batch_takes_kv_cache_memory():
    args = build_parser().parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--kv-cache-memory", "64MiB"])
    assert args.kv_cache_bytes == 64 * MiB and args.num_kv_blocks is None


def test_external_stages_derive_the_controllers_count(tiny_model_dir, monkeypatch):
    from pdserve.commands.stage import _num_kv_blocks

    monkeypatch.setenv("WORLD_SIZE", "3")  # a controller and two stages
    cfg = ModelConfig.from_dir(tiny_model_dir)
    stage = ["stage", "--model-dir", str(tiny_model_dir), "--dtype", "float32"]
    batch = ["batch", "-i", "in", "-o", "out", "--external-stages", "--stages", "2", "--dtype", "float32"]
    for flags in (["--kv-cache-memory", "3MiB"], []):
        stage_args = build_parser().parse_args(stage + flags)
        batch_args = BatchConfig.from_args(build_parser().parse_args(batch + flags))
        assert _num_kv_blocks(stage_args, "cpu") == stage_kv_blocks(batch_args, cfg, "cpu", 5)
    assert _num_kv_blocks(build_parser().parse_args(stage), "cpu") == FIXED_DEFAULT_BLOCKS
