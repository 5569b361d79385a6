"""gpt-oss (GptOssForCausalLM) against Hugging Face transformers on random-weight checkpoints
(tests/engine/factories.py `GPT_OSS`, and `make-tiny-model --arch gpt-oss`).

float32: greedy ids identical and logprobs within 1e-4 on both CPU attention backends, in a batch,
after a cached prefix, with prompts and chunks longer than the 16-key windows (test_new_architectures
runs the same kind on short prompts too); bfloat16 and float16 teacher-forced within the dense
models' 0.2 and 0.05. Its
pieces alone: YaRN tables bit for bit, the experts against transformers' GptOssMLP, the sink softmax
against a float64 reference on every backend path, per-layer windows through the C++ kernels; and
what is refused, each with its key or tensor named. Tensor and expert parallelism:
test_gpt_oss_parallel.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import make_backend, torch_backend
from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from tests.engine.factories import build_checkpoint, hf_greedy

NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4
HALF_ATOL = {"bfloat16": 0.2, "float16": 0.05}  # the dense models' tolerances (tests/gpu/test_cuda_engine.py)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return build_checkpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss"), tiny_model_dir)


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompts(seed: int, n: int, lengths: tuple[int, int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 1700) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def _refused(*args, **kwargs):
    raise AssertionError("cpu_paged ran a gpt-oss step on the torch backend")


def _assert_matches(hf, llm: LLM, prompts: list[list[int]]) -> None:
    for prompt, out in zip(prompts, llm.generate(prompts, _params())):
        ids, ref = hf_greedy(hf, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ids, (len(prompt), comp.token_ids, ids)
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(got, want, atol=LOGPROB_ATOL), (got - want).abs().max()


def test_config_reads_windows_sinks_and_yarn(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.layer_windows == (16, 0, 0, 16) and cfg.sliding_window is None
    assert cfg.attention_sinks and cfg.attention_bias and cfg.output_bias
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0 and cfg.rope_theta == 150000.0
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (6, 2)


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_greedy_matches_transformers_beyond_the_windows(model_dir, backend, monkeypatch):
    """96-token steps: prompts of 100-140 tokens prefill in two chunks, the second after a cached
    prefix; three of them share a 48-token prefix that a first request cached. On cpu_paged the
    decode rows (sinks and all) run the C++ kernel: the torch path is refused for them."""
    llm = LLM(model_dir, num_kv_blocks=512, block_size=8, max_num_batched_tokens=96, attention_backend=backend)
    try:
        if backend == "cpu_paged":  # the fused elementwise ops and the attention kernels run, with the sinks
            attention = llm.engine.runner.attention
            attention.wait_ready()
            assert attention.uses_kernel
            monkeypatch.setattr(attention._fallback, "forward", _refused)
            sink_attention = torch_backend.sink_attention  # a prompt's rows may take it without the prompt kernel

            def prompt_rows_only(q, *args):
                assert q.shape[2] > 1, "a decode row took sink_attention"
                return sink_attention(q, *args)

            monkeypatch.setattr(torch_backend, "sink_attention", prompt_rows_only)
        prefix = [random.Random(3).randrange(5, 1700) for _ in range(48)]
        llm.generate(_prompts(0, 1, (60, 70), prefix), _params())
        prompts = _prompts(1, 3, (100, 140)) + _prompts(2, 3, (52, 92), prefix)
        _assert_matches(_hf(model_dir), llm, prompts)
        llm.engine.check_integrity()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_within_tolerance(model_dir, dtype):
    hf, atol = _hf(model_dir, getattr(torch, dtype)), HALF_ATOL[dtype]
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)
    try:
        prompts = _prompts(6, 4, (20, 90))
        for prompt, out in zip(prompts, llm.generate(prompts, _params())):
            comp = out.outputs[0]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + comp.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
            ref = torch.log_softmax(logits, dim=-1)
            got = torch.tensor([lp.logprob for lp in comp.logprobs])
            want = ref[torch.arange(NEW_TOKENS), torch.tensor(comp.token_ids)]
            assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
            top2 = ref.topk(2, dim=-1).values
            for i, t in enumerate(comp.token_ids):  # another pick only where transformers sees a near-tie
                assert ref[i].argmax().item() == t or (top2[i, 0] - top2[i, 1]).item() < 2 * atol
    finally:
        llm.close()


def test_built_in_tiny_gpt_oss_matches_transformers(tmp_path):
    """`pdserve make-tiny-model --arch gpt-oss`: a checkpoint transformers loads, served the same."""
    from pdserve.engine.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", arch="gpt-oss")
    assert ModelConfig.from_dir(path).layer_windows == (16, 0, 16, 0)
    llm = LLM(path, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)
    try:
        _assert_matches(_hf(path), llm, _prompts(9, 2, (60, 80)))
    finally:
        llm.close()


YARN_CASES = list(
    itertools.product(
        [{"factor": 32.0}, {"factor": 4.0, "truncate": False}, {"factor": 40.0, "beta_fast": 16, "beta_slow": 2}],
        [{}, {"mscale": 0.707, "mscale_all_dim": 0.707}, {"attention_factor": 1.25}],
        [(64, 150000.0, 4096), (16, 10000.0, 64)],
    )
)


@pytest.mark.parametrize("keys, attention, geometry", YARN_CASES)
def test_yarn_tables_are_transformers_bit_for_bit(keys, attention, geometry):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdserve.engine.layers import yarn_inv_freq
    from pdserve.engine.rope_config import parse_rope_scaling

    dim, theta, original = geometry
    rope = {"rope_type": "yarn", "original_max_position_embeddings": original, **keys, **attention}
    hf_cfg = GptOssConfig(
        head_dim=dim,
        max_position_embeddings=int(original * keys["factor"]),
        rope_parameters=dict(rope, rope_theta=theta),
    )
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    scaling = parse_rope_scaling(rope)
    assert scaling is not None and not hasattr(scaling, "low_freq_factor")
    got, factor = yarn_inv_freq(dim, theta, scaling)  # type: ignore[arg-type]
    assert torch.equal(got, want) and factor == want_factor


def test_experts_match_transformers_past_the_clamp(model_dir):
    """GptOssMoe from the checkpoint's fused, interleaved tensors against transformers' GptOssMLP on
    hidden states large enough that gate and up values pass the clamp at 7."""
    from safetensors.torch import load_file

    from pdserve.engine.gpt_oss import GptOssMoe
    from pdserve.engine.layers import EagerOps

    hf_layer = _hf(model_dir).model.layers[1].mlp
    cfg = ModelConfig.from_dir(model_dir)
    moe = GptOssMoe.load(cfg, load_file(str(model_dir / "model.safetensors")), 1, prepack=False)
    h = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 2.0
    with torch.no_grad():
        want, _ = hf_layer(h[None])
        gate_up = h @ hf_layer.experts.gate_up_proj[0] + hf_layer.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()
    torch.testing.assert_close(moe.forward(h, EagerOps.silu_mul), want[0], atol=1e-5, rtol=1e-5)


def _sink_reference(q, pool, tables, q_lens, ctxs, bs, scale, window, sinks):
    """float64, position by position: the scores of a query's visible keys and its head's sink, one
    softmax over both, the sink's share dropped."""
    out, t = [], 0
    group = q.shape[1] // pool.shape[2]
    for table, q_len, ctx in zip(tables, q_lens, ctxs):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // bs]
        keys = pool[blocks, 0, :, pos % bs].double().repeat_interleave(group, dim=1)
        values = pool[blocks, 1, :, pos % bs].double().repeat_interleave(group, dim=1)
        for j in range(q_len):
            n = ctx - q_len + j + 1
            first = max(0, n - window) if window else 0
            scores = torch.einsum("hd,khd->hk", q[t].double(), keys[first:n]) * scale
            probs = torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
            out.append(torch.einsum("hk,khd->hd", probs, values[first:n]))
            t += 1
    return torch.stack(out)


def _mixed_step(d: int = 32):
    """A step of decode tokens, a short and a long chunk after cached context, and a fresh prompt,
    every one longer than a window of 8."""
    g = torch.Generator().manual_seed(5)
    hkv, hq, bs = 2, 6, 4
    q_lens, ctxs = [1, 5, 40, 1, 30], [23, 17, 70, 9, 30]
    perm = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for c in ctxs:
        tables.append(perm[used : used + -(-c // bs)])
        used += len(tables[-1])
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (hq, hkv, hkv))
    batch = ForwardBatch([f"s{i}" for i in range(5)], [7] * total, q_lens, ctxs, tables, [True] * 5)
    pool = torch.randn(64, 2, hkv, bs, d, generator=g)
    return q, k, v, pool, batch, tables, q_lens, ctxs, bs, torch.randn(hq, generator=g) * 2


@pytest.mark.parametrize("backend_name", ["torch", "cpu_paged"])
@pytest.mark.parametrize("window, meta_window, expect", [(8, None, 8), (0, 8, 0), (None, 8, 8), (None, None, 0)])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_backends_honour_layer_windows_and_sinks(backend_name, window, meta_window, expect, with_sinks):
    """`window` None takes the step's window, 0 none, W its own; cpu_paged runs a layer with or
    without sinks on its kernels with that window; both against float64."""
    q, k, v, pool, batch, tables, q_lens, ctxs, bs, sinks = _mixed_step()
    meta = AttentionMetadata.build(batch, bs, torch.device("cpu"), meta_window)
    backend = make_backend(backend_name)
    if backend_name == "cpu_paged":
        backend.wait_ready()
        assert backend.uses_kernel
    layer_sinks = sinks if with_sinks else None
    got = backend.forward(q, k, v, pool, meta, 0.2, window=window, sinks=layer_sinks)
    if not with_sinks:
        sinks = torch.full_like(sinks, float("-inf"))  # exp(-inf) = 0: the plain softmax
    want = _sink_reference(q, pool, tables, q_lens, ctxs, bs, 0.2, expect, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_decode_only_steps_take_sinks_and_windows():
    """Decode-only steps take the batched decode path (and its sink branch)."""
    q, k, v, pool, batch, tables, q_lens, ctxs, bs, sinks = _mixed_step()
    rows = [0, 1 + 5 + 40]  # the rows of the step's two decode sequences, s0 and s3
    decode = ForwardBatch(["s0", "s3"], [7, 7], [1, 1], [ctxs[0], ctxs[3]], [tables[0], tables[3]], [True, True])
    meta = AttentionMetadata.build(decode, bs, torch.device("cpu"))
    got = make_backend("torch").forward(q[rows], k[rows], v[rows], pool, meta, 0.2, window=8, sinks=sinks)
    want = _sink_reference(q[rows], pool, [tables[0], tables[3]], [1, 1], [ctxs[0], ctxs[3]], bs, 0.2, 8, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json, as published (but its list of layer_types: the default)
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_the_published_20b_config_reads_as_transformers_reads_it():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from pdserve.engine.layers import RotaryEmbedding

    cfg = ModelConfig.from_dict(GPT_OSS_20B)
    hf = GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    assert cfg.mxfp4 and cfg.sliding_window is None and cfg.moe is not None and cfg.moe.top_k == 4
    assert cfg.layer_windows == tuple(128 if t == "sliding_attention" else 0 for t in hf.layer_types)
    want = GptOssRotaryEmbedding(hf)
    got = RotaryEmbedding(cfg, torch.device("cpu"))
    assert torch.equal(got.inv_freq, want.inv_freq) and got.attention_factor == want.attention_scaling


def _raw(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]},
            r"layer_types\[1\]",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"sliding_window": None}, r"layer_types\[0\] is sliding_attention but sliding_window"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
        ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, "needs factor"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ],
)
def test_bad_configs_are_refused_by_key(model_dir, change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(_raw(model_dir), **change))


def test_mxfp4_elsewhere_is_refused(tiny_model_dir):
    llama = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        ModelConfig.from_dict(dict(llama, quantization_config={"quant_method": "mxfp4"}))


def test_a_sink_tensor_of_the_wrong_shape_is_refused_at_load(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.2.self_attn.sinks"] = torch.zeros(7)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.sinks has shape \[7\].*\[6\]"):
        LLM(bad, num_kv_blocks=64, block_size=8)


def test_flashinfer_refuses_sinks_at_configure(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    from pdserve.engine.attention.flashinfer_backend import FlashInferAttention

    with pytest.raises(ValueError, match="attention sinks"):
        FlashInferAttention().configure(4, torch.bfloat16, attention_sinks=True)


def test_other_architectures_keep_their_defaults(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert cfg.layer_windows is None and not cfg.attention_sinks and cfg.swiglu is None
    assert cfg.layer_window(0) is None and dataclasses.replace(cfg, layer_windows=(5,)).layer_window(0) == 5
