"""pdserve.engine.prompt_check: the one prompt validation of the router, the nodes, the engine and `pdserve batch`."""

from __future__ import annotations

import pytest

from pdserve.engine.prompt_check import PromptError, check_max_tokens, check_prompt


@pytest.mark.parametrize(
    "ids, kwargs, match",
    [
        ([], {}, "prompt is empty"),
        ([5, -1], {}, r"token id -1 is outside the vocabulary \[0, 100\)"),
        ([5, 100], {}, r"token id 100 is outside the vocabulary \[0, 100\)"),
        ([5, "6"], {}, r"token id '6' is outside"),
        ([5] * 11, {"max_prompt_tokens": 10}, "this server accepts at most 10"),
        ([5] * 20, {}, "more than this model's context of 20 .max_model_len"),
    ],
)
def test_bad_prompts_name_the_problem_and_the_field(ids, kwargs, match):
    with pytest.raises(PromptError, match=match) as err:
        check_prompt(ids, vocab_size=100, max_model_len=20, **kwargs)
    assert err.value.param == "prompt" and isinstance(err.value, ValueError)  # ValueError: INVALID_ARGUMENT on nodes


def test_good_prompt_and_the_max_tokens_budget():
    assert check_prompt((1, 2, 3), vocab_size=100, max_model_len=4) == [1, 2, 3]
    check_max_tokens(3, 1, 4)
    with pytest.raises(
        PromptError, match="context length is 4 tokens .max_model_len.; the prompt has 3 and max_tokens is 2"
    ) as err:
        check_max_tokens(3, 2, 4)
    assert err.value.param == "max_tokens"
