"""float16 on CPU runs the torch path throughout, also once the compiled CPU ops (float32/bfloat16
only) are built: it never switches to them mid-run."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kernels import cpu_build

PROMPTS = ["The old lighthouse keeper", "a b c d e f g h i j k l m n o p q r s t u v w x y z"]


def _generate(tiny_model_dir, backend: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(tiny_model_dir, dtype="float16", attention_backend=backend, num_kv_blocks=64, block_size=4)
    llm.engine.runner.attention.wait_ready()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_float16_on_cpu_paged_after_the_ops_are_built(tiny_model_dir):
    if cpu_build.load_paged_attention_op() is None:  # no compiler: the timing case cannot happen
        pytest.skip("the CPU ops cannot be built here")
    assert cpu_build.current_op() is not None  # built and loaded in this process
    paged, paged_tokens = _generate(tiny_model_dir, "cpu_paged")
    assert paged.engine.runner.kv_pool.tensor.dtype == torch.float16
    assert not paged.engine.runner.attention.uses_kernel
    _, reference = _generate(tiny_model_dir, "torch")
    assert paged_tokens == reference and all(len(t) == 12 for t in paged_tokens)


def test_bfloat16_still_takes_the_ops(tiny_model_dir):
    if cpu_build.load_paged_attention_op() is None:
        pytest.skip("the CPU ops cannot be built here")
    llm = LLM(tiny_model_dir, dtype="bfloat16", attention_backend="cpu_paged", num_kv_blocks=16)
    llm.engine.runner.attention.wait_ready()
    assert llm.engine.runner.attention.uses_kernel
