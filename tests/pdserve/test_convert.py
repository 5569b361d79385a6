"""Wire sampling params -> engine SamplingParams (`pdserve.runtime.convert.params_from_pb`)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.sampling_params import SamplingParams
from pdserve.runtime.convert import params_from_pb
from pdserve.v1 import common_pb2


def test_every_proto_sampling_field_is_an_engine_field_of_the_same_name():
    """params_from_pb copies fields by name: a proto field without an engine twin would be lost."""
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    proto_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    assert proto_fields <= engine_fields, proto_fields - engine_fields


def test_every_field_arrives():
    values = dict(
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        min_p=0.125,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        max_tokens=9,
        min_tokens=2,
        stop=["\n\n"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        logprobs=2,
        include_stop_str_in_output=True,
        logit_bias={7: -100.0, 2: 1.5},
        skip_special_tokens=False,
    )
    pb = common_pb2.SamplingParams(**values)
    # the engine holds the repeated fields as tuples (logit_bias as sorted pairs)
    expected = {**values, "stop": ("\n\n",), "stop_token_ids": (3, 4), "logit_bias": ((2, 1.5), (7, -100.0))}
    assert params_from_pb(pb) == SamplingParams(**expected)


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
