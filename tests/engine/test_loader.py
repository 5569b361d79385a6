from __future__ import annotations

import json
import time

import pytest
import torch

from pdserve.engine.attention.plan import paged_plan, slot_mapping
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tiny_model import make_tiny_model
from pdserve.engine.weights import needed_tensor_names, resolve_dtype


def test_layer_slices_load_only_what_they_need(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    first = needed_tensor_names(cfg, (0, 2))
    last = needed_tensor_names(cfg, (2, 4))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    assert not any(".layers.2." in n for n in first) and not any(".layers.1." in n for n in last)
    tied = ModelConfig.from_dict(
        {**json.loads((tiny_model_dir / "config.json").read_text()), "tie_word_embeddings": True}
    )
    assert "model.embed_tokens.weight" in needed_tensor_names(tied, (2, 4))


def test_pipeline_slices_compose_to_the_full_model(tiny_model_dir):
    from pdserve.engine.forward_batch import ForwardBatch

    batch = ForwardBatch(["a"], [5, 6, 7, 8, 9], [5], [5], [[0, 1]], [True])
    full = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=4).run(batch)
    head = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=4, layer_range=(0, 2))
    tail = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=4, layer_range=(2, 4))
    hidden = head.run(batch)
    assert hidden.shape == (5, head.model_config.hidden_size) and tail.kv_pool.num_layers == 2
    sent = hidden.clone()
    assert torch.allclose(tail.run(batch, hidden_states=hidden), full, atol=1e-5)
    assert torch.equal(hidden, sent), "a stage updates its residual stream in place, never the caller's tensor"


def test_rejects_unsupported_architecture_and_rope():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_scaling rope_type 'longrope'"):  # yarn is served (gpt-oss)
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    qwen = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias


def test_dtype_option(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", cfg, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cfg, torch.device("cpu"))
    runner = ModelRunner(tiny_model_dir, dtype="bfloat16", num_kv_blocks=4)
    assert runner.kv_pool.tensor.dtype == torch.bfloat16


def test_tiny_model_is_deterministic_and_fast(tmp_path, tiny_model_dir):
    a, b = make_tiny_model(tmp_path / "a"), make_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    start = time.perf_counter()
    ModelRunner(a, num_kv_blocks=16)
    assert time.perf_counter() - start < 1.0


def test_transformers_loads_the_builtin_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.num_hidden_layers == 4
    assert AutoTokenizer.from_pretrained(tiny_model_dir).chat_template


def test_paged_plan_and_slot_mapping():
    plan = paged_plan([3, 1], [3, 9], [[7, 8], [1, 2, 3, 4]], page_size=4)
    assert plan.qo_indptr == [0, 3, 4]
    assert plan.kv_indptr == [0, 1, 4] and plan.kv_indices == [7, 1, 2, 3]
    assert plan.kv_last_page_len == [3, 1]
    blocks, offsets, positions = slot_mapping([3, 1], [3, 9], [[7, 8], [1, 2, 3, 4]], 4)
    assert blocks == [7, 7, 7, 3] and offsets == [0, 1, 2, 0] and positions == [0, 1, 2, 8]
