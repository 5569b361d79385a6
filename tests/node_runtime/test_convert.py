"""Wire sampling params -> engine SamplingParams (`node_runtime.convert.params_from_pb`); that every field
arrives is tests/architecture/test_sampling_surface.py."""

from __future__ import annotations


import pytest

from pdserve.node_runtime.convert import params_from_pb
from pdserve.v1 import common_pb2


def test_unset_optional_fields_take_the_engine_defaults():
    params = params_from_pb(common_pb2.SamplingParams(max_tokens=4))
    assert (params.top_p, params.repetition_penalty, params.seed, params.logprobs) == (1.0, 1.0, None, None)


@pytest.mark.parametrize(
    "fields, name",
    [
        ({}, "max_tokens"),  # unset: required
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),  # 0 is a value (out of range), never "unset"
        ({"max_tokens": 4, "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 4, "logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"max_tokens": 4, "logit_bias": {1: 101.0}}, "logit_bias"),
    ],
)
def test_zero_is_never_unset(fields, name):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {name}"):
        params_from_pb(common_pb2.SamplingParams(**fields))
