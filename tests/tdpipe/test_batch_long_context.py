"""Long-context models in `pdserve batch` (tdpipe/runtime/batch_lengths.py): a chat line without
max_tokens on a 32k-context model runs (up to what the pipeline's KV holds, as the serving engine
does), the planner admits requests on predicted lengths, and only what cannot fit is refused, line
by line."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.choices import ChoiceBuilder
from pdserve.tdpipe.predictor import BucketPredictor
from pdserve.tdpipe.runtime.batch_io import LineError, parse_line
from pdserve.tdpipe.runtime.batch_lengths import DEFAULT_PREDICTED_LEN, LengthPlanner, fills_context, fit_line
from tests.tdpipe.batch_helpers import batch_cmd, read_results

LONG_CONTEXT = 32768
KV_TOKENS = 128 * 4  # batch_cmd's --num-kv-blocks 128 --block-size 4
JOB_BLOCKS = 24
"""The end-to-end job's pool (96 tokens): the defaulted line runs to its end in few steps."""


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory):
    """The tiny model configured with a 32k context (its weights do not depend on it)."""
    d = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": LONG_CONTEXT}))
    return d


def _line(cid: str, url: str = "/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _item(builder: ChoiceBuilder, **body):
    return parse_line(_line("x", **body), builder, "m")


def test_a_defaulted_chat_line_is_capped_at_the_kv_and_a_stated_one_refused(long_model) -> None:
    builder = ChoiceBuilder(Tokenizer(long_model), lambda: LONG_CONTEXT)
    hi = [{"role": "user", "content": "hi"}]
    free = _item(builder, messages=hi)
    assert fills_context(free) and free.choice.request.params.max_tokens > KV_TOKENS  # context - prompt
    fit_line(free, KV_TOKENS)
    assert len(free.choice.request.prompt_token_ids) + free.choice.request.params.max_tokens == KV_TOKENS
    stated = _item(builder, messages=hi, max_tokens=KV_TOKENS)
    assert not fills_context(stated)
    with pytest.raises(LineError, match="KV holds 512") as e:
        fit_line(stated, KV_TOKENS)
    assert e.value.code == "prompt_too_long" and e.value.status == 400
    huge = _item(builder, messages=[{"role": "user", "content": "word " * 700}])
    with pytest.raises(LineError):  # no room left for a single token
        fit_line(huge, KV_TOKENS)
    small = _item(builder, messages=hi, max_completion_tokens=7)
    fit_line(small, KV_TOKENS)
    assert small.choice.request.params.max_tokens == 7


def test_length_planner_heuristic_and_trained_predictor(long_model, tmp_path) -> None:
    tok = Tokenizer(long_model)
    builder = ChoiceBuilder(tok, lambda: LONG_CONTEXT)
    hi = [{"role": "user", "content": "hi"}]
    free = _item(builder, messages=hi)
    stated = [_item(builder, messages=hi, max_tokens=n) for n in (10, 30, 50)]
    # lines that name max_tokens plan on it; a defaulted one on their median, not on 32k
    assert LengthPlanner().predict([free, *stated], tok) == [30, 10, 30, 50]
    assert LengthPlanner().predict([free], tok) == [DEFAULT_PREDICTED_LEN]
    prompts = [f"short question {i}" for i in range(8)] + [f"write a long essay {i}" for i in range(8)]
    model = BucketPredictor.train(prompts, [5] * 8 + [400] * 8, "hashing", epochs=100)
    model.save(tmp_path / "pred")
    planner = LengthPlanner(str(tmp_path / "pred"))
    assert planner.source.startswith("predictor")
    guesses = planner.predict([free, stated[0]], tok)
    assert 1 <= guesses[0] < free.choice.request.params.max_tokens and guesses[1] <= 10  # never above max_tokens
    with pytest.raises(ValueError, match="predictor.json"):
        LengthPlanner(str(tmp_path / "missing"))


def test_chat_without_max_tokens_runs_on_a_32k_context_model(tmp_path, long_model) -> None:
    hi = [{"role": "user", "content": "hi"}]
    lines = [
        _line("free", messages=hi, temperature=0),  # no max_tokens: context - prompt = 32k - prompt
        _line("stated", messages=hi, temperature=0, max_tokens=JOB_BLOCKS * 4),  # names more than fits
        _line("huge", messages=[{"role": "user", "content": "word " * 700}], temperature=0),
        _line("short", messages=hi, temperature=0, max_tokens=6, ignore_eos=True),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        batch_cmd(tmp_path, "--model", str(long_model), "--cost-table", "analytic", "--num-kv-blocks", str(JOB_BLOCKS)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["custom_id"]: r["response"] for r in read_results(tmp_path / "out.jsonl")}
    for cid in ("stated", "huge"):
        assert rows[cid]["status_code"] == 400 and rows[cid]["body"]["error"]["code"] == "prompt_too_long", cid
    assert rows["short"]["status_code"] == 200
    free = rows["free"]
    assert free["status_code"] == 200, free
    # the serving engine on the same pool lowers its context to the pool: same text, same usage
    llm = LLM(long_model, num_kv_blocks=JOB_BLOCKS, block_size=4)
    want = llm.chat(hi, SamplingParams(temperature=0.0, max_tokens=None))[0]  # the context left, as HTTP
    body = free["body"]
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    assert body["choices"][0]["finish_reason"] == want.outputs[0].finish_reason
    assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= JOB_BLOCKS * 4
