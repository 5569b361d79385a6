from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, apply_penalties, make_generator, sample_one
from pdserve.engine.sampling_params import SamplingParams


def req(params: SamplingParams, prompt=(1, 2), output=()) -> Request:
    r = Request("r", list(prompt), params, 16)
    r.output_token_ids = list(output)
    return r


def test_greedy_and_logprobs_of_raw_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    r = req(SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0), output=[1])
    ((token, lp),) = Sampler()(logits, [r], {})
    raw = torch.log_softmax(logits[0], -1)
    assert token == 1  # penalty 2.0 on token 1: 3.0 - 2.0 = 1.0 ties token 2, argmax takes the first
    assert lp.logprob == pytest.approx(float(raw[1]))
    assert [t for t, _ in lp.top] == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [True, False])
def test_greedy_batch_picks_the_first_maximum_of_each_row(monkeypatch, dtype, compiled):
    # the all-greedy batch takes one reduction over the rows, the compiled `greedy` op where it is
    # loaded (bf16 logits read as they are), else torch's: ties, -inf and NaN as argmax does
    from pdserve.engine.kernels import cpu_build

    if compiled:
        assert cpu_build.load_paged_attention_op() is not None, "this machine has a C++ compiler"
    else:
        monkeypatch.setattr(cpu_build, "current_op", lambda: None)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (40, 3000), generator=gen).to(dtype)
    logits[3, :] = 1.0
    logits[5, [7, 2999]] = float("inf")
    logits[9, :] = -float("inf")
    logits[11, 17] = float("nan")
    reqs = [req(SamplingParams(temperature=0.0)) for _ in range(len(logits))]
    tokens = [t for t, _ in Sampler()(logits, reqs, {})]
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert (tokens[3], tokens[5], tokens[9], tokens[11]) == (0, 7, 0, 17)
    columns = logits.t().contiguous().t()  # the same values, rows not contiguous: torch's max takes them
    assert [t for t, _ in Sampler()(columns, reqs, {})] == tokens


def test_bf16_logits_are_widened_for_logprobs_and_sampling():
    """A bf16 model's logits reach the sampler as they are; any request that needs more than their
    maximum (logprobs, penalties, sampling) sees their float32 widening."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.5, 2.5, 0.0]]).bfloat16()
    greedy_lp = req(SamplingParams(temperature=0.0, logprobs=1))
    sampled = req(SamplingParams(temperature=1.0, top_k=1, seed=1))
    out = Sampler()(logits, [greedy_lp, sampled], {"r": make_generator(1)})
    assert [t for t, _ in out] == [1, 2]
    assert out[0][1].logprob == pytest.approx(float(torch.log_softmax(logits[0].float(), -1)[1]))


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(row, req(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1]))
    assert row.tolist() == [1.0, -4.0, 1.0, 0.5]
    row = torch.tensor([0.0, 0.0, 0.0])
    apply_penalties(row, req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), output=[2, 2, 1]))
    assert row.tolist() == [0.0, -0.75, -1.0]


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_p=0.1), {0}),
    ]:
        gen = make_generator(0)
        seen = {sample_one(logits, req(params), gen) for _ in range(200)}
        assert seen == allowed, (params, seen)


def test_seed_reproducible_and_temperature_spreads():
    logits = torch.zeros(50)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample_one(logits, req(p), g) for g in [make_generator(7)] for _ in range(20)]
    b = [sample_one(logits, req(p), g) for g in [make_generator(7)] for _ in range(20)]
    assert a == b and len(set(a)) > 5


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("logprobs", 21),
        ("n", 0),
        ("min_tokens", -1),
        ("stop", [""]),
    ],
)
def test_bad_params_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    r = req(SamplingParams(temperature=0.0, logprobs=0, logit_bias={3: 100.0, 1: -100.0}))
    ((token, lp),) = Sampler()(logits, [r], {})
    assert token == 3 and lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))
    banned = req(SamplingParams(temperature=1.0, seed=1, logit_bias={1: -100.0, 2: -100.0, 3: -100.0}))
    gen = make_generator(1)
    assert {Sampler()(logits, [banned], {"r": gen})[0][0] for _ in range(20)} == {0}


@pytest.mark.parametrize(
    "bias", [{0: 100.5}, {0: -101.0}, {-1: 1.0}, {i: 1.0 for i in range(301)}], ids=["high", "low", "id", "many"]
)
def test_logit_bias_bounds_are_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_beyond_the_vocabulary_is_refused_at_admission(tiny_model_dir):
    from pdserve.engine import LLM

    llm = LLM(tiny_model_dir, num_kv_blocks=16)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        llm.engine.add_request("r", [1, 2], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))


def test_draw_follows_the_distribution_and_never_picks_a_zero_probability_index():
    from pdserve.engine.sampler import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    gen = make_generator(11)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=6)
    assert counts[0] == counts[2] == counts[5] == 0
    # within 4 standard deviations of n*p (the seed is fixed: this is deterministic, not flaky)
    for i, p in ((1, 0.5), (3, 0.2), (4, 0.3)):
        assert abs(counts[i] - n * p) < 4 * (n * p * (1 - p)) ** 0.5, (i, counts.tolist())
    # unnormalised weights, and a distribution with one index left
    assert {draw(torch.tensor([0.0, 3.0, 1.0]), gen) for _ in range(200)} == {1, 2}
    assert {draw(torch.tensor([0.0, 0.0, 7.0]), gen) for _ in range(20)} == {2}


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_draw_refuses_a_distribution_it_cannot_sample(bad):
    from pdserve.engine.sampler import draw

    with pytest.raises(RuntimeError, match="cannot sample"):
        draw(torch.tensor(bad), make_generator(0))
