"""gpt-oss over two tensor-parallel ranks: heads (q/k/v and their biases, the sinks) split, o_proj by
columns with its bias added once, each expert's width split (gate/up interleaved along 2I) or, with
expert parallelism, whole experts per rank with their biases.

The checkpoint (factories `gpt-oss-tp`): 6 query heads and 6 experts, 3 a rank; 2 KV heads, one a
rank; experts 96 wide, 48 a rank, so in MXFP4 the second rank's down_proj starts inside a block of
32. float32 greedy ids identical to transformers and logprobs within 1e-4, prompts longer than the
16-key windows and prefilled in two chunks; each rank's tensors against the whole checkpoint's; what
cannot be split is refused naming the quantity.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import TPShard
from pdserve.engine.weights import load_tensors
from tests.engine.factories import build_checkpoint, hf_greedy
from tests.engine.test_mxfp4 import to_mxfp4

NEW_TOKENS = 10
LOGPROB_ATOL = 1e-4
EXPERTS = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return build_checkpoint("gpt-oss-tp", tmp_path_factory.mktemp("gpt-oss-tp"), tiny_model_dir)


@pytest.fixture(scope="module")
def mxfp4_dir(model_dir, tmp_path_factory):
    return to_mxfp4(model_dir, tmp_path_factory.mktemp("gpt-oss-tp-mxfp4"))


def _hf(path, mxfp4: bool = False):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # transformers dequantizes MXFP4 on CPU at load: the weights pdserve dequantizes too
    quant = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **quant).eval()


def _prompts() -> list[list[int]]:
    """Four prompts of 20-130 tokens: past the 16-key windows, the longer ones in two 96-token chunks
    (a seed whose greedy steps have top-2 margins over 0.01 in both checkpoints: no near-ties)."""
    rng = random.Random(4)
    return [[rng.randrange(5, 1700) for _ in range(n)] for n in (20, 70, 110, 130)]


def _assert_matches(hf, llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids, ref = hf_greedy(hf, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ids, (len(prompt), comp.token_ids, ids)
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(got, want, atol=LOGPROB_ATOL), (got - want).abs().max()
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def _two_ranks(path, expert_parallel: bool) -> LLM:
    return LLM(
        path,
        num_kv_blocks=256,
        block_size=8,
        max_num_batched_tokens=96,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_match_transformers(model_dir, expert_parallel):
    llm = _two_ranks(model_dir, expert_parallel)
    try:
        _assert_matches(_hf(model_dir), llm, _prompts())
    finally:
        llm.close()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["mxfp4-tp2", "mxfp4-ep2"])
def test_two_ranks_of_an_mxfp4_checkpoint_match_transformers(mxfp4_dir, expert_parallel):
    llm = _two_ranks(mxfp4_dir, expert_parallel)
    try:
        _assert_matches(_hf(mxfp4_dir, mxfp4=True), llm, _prompts())
    finally:
        llm.close()


def _rank_tensors(path, cfg: ModelConfig, expert_parallel: bool) -> list[dict[str, torch.Tensor]]:
    layers = (0, cfg.num_hidden_layers)
    return [
        load_tensors(path, cfg, layers, torch.float32, torch.device("cpu"), TPShard(r, 2, expert_parallel))
        for r in (0, 1)
    ]


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "mxfp4"])
def test_rank_tensors_reassemble_the_checkpoint(model_dir, mxfp4_dir, quantized):
    """Each expert's I halves (gate_up's interleaved columns [2 * i0, 2 * i1)) or each rank's experts
    put back together give the whole tensors; the sinks and q/k/v biases follow the heads; biases
    after a row-parallel projection are rank 0's, zeros on rank 1 (experts' down bias: not under
    expert parallelism)."""
    path = mxfp4_dir if quantized else model_dir
    cfg = ModelConfig.from_dir(path)
    whole = load_tensors(path, cfg, (0, cfg.num_hidden_layers), torch.float32, torch.device("cpu"))
    split = _rank_tensors(path, cfg, expert_parallel=False)
    for name, dim in [("gate_up_proj", 2), ("gate_up_proj_bias", 1), ("down_proj", 1)]:
        assert torch.equal(torch.cat([t[EXPERTS + name] for t in split], dim), whole[EXPERTS + name]), name
    for name in (EXPERTS + "down_proj_bias", "model.layers.1.self_attn.o_proj.bias"):
        assert torch.equal(split[0][name], whole[name]) and not split[1][name].any(), name
    for name in ("self_attn.sinks", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"):
        name = "model.layers.2." + name
        assert torch.equal(torch.cat([t[name] for t in split]), whole[name]), name
    assert split[1]["model.layers.2.self_attn.sinks"].shape == (3,)
    placed = _rank_tensors(path, cfg, expert_parallel=True)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert placed[1][EXPERTS + name].shape[0] == 3
        assert torch.equal(torch.cat([t[EXPERTS + name] for t in placed]), whole[EXPERTS + name]), name
    assert torch.equal(placed[1]["model.layers.1.mlp.router.weight"], whole["model.layers.1.mlp.router.weight"])


def test_rank_configs_hold_their_share(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.moe is not None
    tp, ep = TPShard(1, 2).local_config(cfg), TPShard(1, 2, expert_parallel=True).local_config(cfg)
    assert (tp.num_attention_heads, tp.num_key_value_heads) == (3, 1) == (ep.num_attention_heads, 1)
    assert tp.moe is not None and (tp.moe.intermediate_size, tp.moe.expert_range) == (48, None)
    assert ep.moe is not None and (ep.moe.intermediate_size, ep.moe.expert_range) == (96, (3, 6))
    assert ep.moe.num_experts == 6  # routing is over all experts on every rank


def _with(cfg: ModelConfig, **moe) -> ModelConfig:
    assert cfg.moe is not None
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))


@pytest.mark.parametrize(
    "change, size, expert_parallel, match",
    [
        (lambda c: dataclasses.replace(c, num_attention_heads=5), 2, False, "the 5 attention heads"),
        (lambda c: _with(c, intermediate_size=95), 2, False, "the experts' width 95"),
        (lambda c: _with(c, num_experts=5), 2, True, "the 5 experts"),
        (lambda c: c, 4, False, "the 6 attention heads"),
        (lambda c: dataclasses.replace(c, num_attention_heads=8, num_key_value_heads=4), 4, True, "the 6 experts"),
    ],
    ids=["heads", "width", "experts", "four-ranks", "four-experts-ranks"],
)
def test_what_cannot_be_split_is_refused_by_name(model_dir, change, size, expert_parallel, match):
    with pytest.raises(ValueError, match=match):
        TPShard(0, size, expert_parallel).check(change(ModelConfig.from_dir(model_dir)))


def test_four_ranks_are_refused_before_any_starts(model_dir):
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide the 6 attention heads"):
        LLM(model_dir, num_kv_blocks=64, block_size=8, tensor_parallel_size=4)
