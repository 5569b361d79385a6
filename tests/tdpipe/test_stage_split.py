"""The pipeline's stage split weighs the last stage's LM head (tdpipe/runtime/stage_split.py)."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tiny_model import SIZES
from pdserve.tdpipe.runtime.stage_split import (
    decoder_layer_weights,
    OP_OVERHEAD_WEIGHTS,
    lm_head_layers,
    model_stage_ranges,
    stage_layer_range,
    stage_layer_ranges,
)
from pdserve.tdpipe.runtime.stage_worker import stage_layer_range as worker_stage_layer_range


def _config(**over) -> ModelConfig:
    raw = {**SIZES["bench"], "architectures": ["LlamaForCausalLM"], **over}
    return ModelConfig.from_dict(raw)


def _costs(ranges: list[tuple[int, int]], head: float) -> list[float]:
    costs = [float(end - start) for start, end in ranges]
    costs[-1] += head
    return costs


def _equal_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """The split before the head was weighed: equal, the remainder on the earlier stages."""
    base, extra = divmod(num_layers, num_stages)
    starts = [k * base + min(k, extra) for k in range(num_stages + 1)]
    return list(zip(starts, starts[1:]))


def test_bench_head_costs_about_five_layers() -> None:
    cfg = _config()
    # q, o: 768 x 768; k, v: 768 x (4 heads x 64); gate, up, down: 768 x 1536
    assert decoder_layer_weights(cfg) == 2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 1536
    overhead = OP_OVERHEAD_WEIGHTS
    assert lm_head_layers(cfg) == pytest.approx((768 * 32000 + 2 * overhead) / (5_111_808 + 9 * overhead))
    assert 4.1 < lm_head_layers(cfg) < 4.3
    # tying the head to the embedding does not make its matmul cheaper
    assert lm_head_layers(_config(tie_word_embeddings=True)) == lm_head_layers(cfg)
    # an explicit head_dim wins over hidden / heads (GQA models whose heads are not hidden / heads wide)
    wide = _config(head_dim=128)
    assert decoder_layer_weights(wide) == 2 * 768 * 12 * 128 + 2 * 768 * 4 * 128 + 3 * 768 * 1536


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_bench_split_makes_the_dearest_stage_cheaper(num_stages) -> None:
    cfg = _config()
    head = lm_head_layers(cfg)
    ranges = model_stage_ranges(cfg, num_stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == 12
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous: every layer once
    assert all(end > start for start, end in ranges)  # every stage holds a layer
    assert max(_costs(ranges, head)) < max(_costs(_equal_split(12, num_stages), head))
    if num_stages == 2:
        assert ranges == [(0, 8), (8, 12)]  # 8 vs 8.2 layer-equivalents instead of 6 vs 10.2


def test_split_is_the_best_contiguous_one() -> None:
    """Against every contiguous split (brute force): none has a cheaper dearest stage."""
    for num_layers, num_stages, head in [(12, 2, 4.8), (12, 3, 4.8), (12, 4, 4.8), (7, 3, 2.5), (5, 4, 10.0)]:
        best = min(max(_costs(r, head)) for r in _all_splits(num_layers, num_stages))
        got = stage_layer_ranges(num_layers, num_stages, head)
        assert max(_costs(got, head)) == pytest.approx(best), (num_layers, num_stages, head)


def _all_splits(num_layers: int, num_stages: int, start: int = 0) -> list[list[tuple[int, int]]]:
    if num_stages == 1:
        return [[(start, num_layers)]]
    return [
        [(start, cut), *rest]
        for cut in range(start + 1, num_layers - num_stages + 2)
        for rest in _all_splits(num_layers, num_stages - 1, cut)
    ]


def test_no_head_cost_is_the_equal_split() -> None:
    for num_layers in range(1, 33):
        for num_stages in range(1, num_layers + 1):
            assert stage_layer_ranges(num_layers, num_stages) == _equal_split(num_layers, num_stages)
            assert stage_layer_ranges(num_layers, num_stages, 0.0) == _equal_split(num_layers, num_stages)
    assert worker_stage_layer_range(5, 2, 1) == stage_layer_range(5, 2, 1) == (3, 5)  # the old import still works


def test_a_huge_head_still_leaves_the_last_stage_one_layer() -> None:
    assert stage_layer_ranges(4, 2, 1000.0) == [(0, 3), (3, 4)]
    assert stage_layer_ranges(6, 3, 1000.0) == [(0, 3), (3, 5), (5, 6)]


def test_tiny_keeps_the_equal_split_its_timings_favour(tiny_model_dir) -> None:
    """On the 128-wide tiny model per-op overheads, not weights, set the time: measured, 2 / 2 ran
    1.16 / 1.18 ms per stage and 3 / 1 1.62 / 0.79 ms. Its head is priced under half a layer."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert 0.3 < lm_head_layers(cfg) < 0.6
    assert model_stage_ranges(cfg, 2) == [(0, 2), (2, 4)]


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 1, 0), "at least one layer"),
        ((4, 0, 0), r"stages must be in \[1, 4\]"),
        ((4, 5, 0), r"stages must be in \[1, 4\]"),
        ((4, 2, 2), r"stage must be in \[0, 1\]"),
        ((4, 2, -1), r"stage must be in \[0, 1\]"),
        ((4, 2, 0, -1.0), "extra cost"),
        ((4, 2, 0, math.nan), "extra cost"),
        ((4, 2, 0, math.inf), "extra cost"),
        ((4.0, 2, 0), "at least one layer"),
    ],
)
def test_bad_input_is_refused_clearly(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        stage_layer_range(*args)
