"""The sampling surface, declared once: every field, where it exists, and one value that must travel.

Adding a sampling field is a row here plus the field itself where its row says (the conversions
copy fields by name: openai_api.choices.SHARED_SAMPLING_FIELDS, node_runtime.convert.params_from_pb).
The tests check the HTTP models, the proto, the engine's SamplingParams and the batch validator
against this table, and carry each value from an HTTP body to the engine's params.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import pytest

from pdserve.engine.grammar import GrammarSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.node_runtime.convert import params_from_pb
from pdserve.openai_api.choices import ChoiceBuilder
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.v1 import common_pb2
from pdserve.tdpipe.runtime.batch_io import LineError, parse_line


class Field(NamedTuple):
    value: object
    """Not the default anywhere: a value that arrives proves the field was carried."""
    http: bool
    """A field of the OpenAI request bodies (completions; chat spells two of them its own way)."""
    proto: bool
    """A field of pdserve.v1.SamplingParams (the router fans `n` out into n requests instead)."""
    engine: bool
    """A field of pdserve.engine.SamplingParams."""
    batch: bool
    """`pdserve batch` runs it (False: the line is refused as unsupported)."""


SURFACE = {
    "temperature": Field(0.5, http=True, proto=True, engine=True, batch=True),
    "top_p": Field(0.75, http=True, proto=True, engine=True, batch=True),
    "top_k": Field(7, http=True, proto=True, engine=True, batch=True),
    "min_p": Field(0.125, http=True, proto=True, engine=True, batch=True),
    "seed": Field(11, http=True, proto=True, engine=True, batch=True),
    "presence_penalty": Field(0.5, http=True, proto=True, engine=True, batch=True),
    "frequency_penalty": Field(-0.5, http=True, proto=True, engine=True, batch=True),
    "repetition_penalty": Field(1.25, http=True, proto=True, engine=True, batch=True),
    "max_tokens": Field(9, http=True, proto=True, engine=True, batch=True),
    "min_tokens": Field(2, http=True, proto=True, engine=True, batch=False),
    "stop": Field(["\n\n"], http=True, proto=True, engine=True, batch=True),
    "ignore_eos": Field(True, http=True, proto=True, engine=True, batch=True),
    "logprobs": Field(2, http=True, proto=True, engine=True, batch=False),
    "n": Field(2, http=True, proto=False, engine=True, batch=False),
    "stop_token_ids": Field([3, 4], http=True, proto=True, engine=True, batch=True),
    "include_stop_str_in_output": Field(True, http=True, proto=True, engine=True, batch=True),
    "skip_special_tokens": Field(False, http=True, proto=True, engine=True, batch=True),
    "logit_bias": Field({"7": -100.0, "2": 1.5}, http=True, proto=True, engine=True, batch=True),
    "structured_outputs": Field({"regex": "[a-z]+"}, http=True, proto=True, engine=True, batch=True),
}
NOT_SAMPLING = {
    "model",
    "stream",
    "stream_options",
    "user",
    "prompt",
    "echo",
    "messages",
    "cache_salt",
    "return_token_ids",
}
"""Body fields that are not sampling parameters (cache_salt travels beside them: GenerateRequest.cache_salt;
return_token_ids only shapes the router's response)."""
CHAT_SPELLINGS = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
"""Chat's own names for two fields (chat's `logprobs` is the switch for top_logprobs)."""
SPELLINGS = {
    name: "structured_outputs"
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
}
"""OpenAI's and vLLM's other names for structured output (openai_api.structured): one proto field."""


def where(column: str) -> set[str]:
    return {name for name, f in SURFACE.items() if getattr(f, column)}


def test_the_http_bodies_have_the_http_fields() -> None:
    assert {SPELLINGS.get(n, n) for n in CompletionRequest.model_fields} - NOT_SAMPLING == where("http")
    spellings = CHAT_SPELLINGS | SPELLINGS
    chat = {spellings.get(n, n) for n in ChatCompletionRequest.model_fields} - NOT_SAMPLING
    assert chat == where("http")


def test_the_proto_has_the_proto_fields() -> None:
    assert {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields} == where("proto")


def test_the_engine_has_the_engine_fields() -> None:
    assert {f.name for f in dataclasses.fields(SamplingParams)} == where("engine")


def _engine_value(name: str) -> object:
    value = SURFACE[name].value
    if name == "structured_outputs":  # one kind and its spec in the proto and the engine
        return GrammarSpec("regex", "[a-z]+")
    if isinstance(value, dict):  # logit_bias: string token ids in JSON, sorted (id, bias) pairs in the engine
        return tuple(sorted((int(k), v) for k, v in value.items()))
    return tuple(value) if isinstance(value, list) else value  # the engine holds sequences as tuples


@pytest.fixture(scope="module")
def builder(tiny_model_dir) -> ChoiceBuilder:
    return ChoiceBuilder(Tokenizer(str(tiny_model_dir)), lambda: 4096)


def test_every_value_travels_from_the_body_to_the_engine(builder) -> None:
    body = {name: f.value for name, f in SURFACE.items() if f.http}
    choices = builder.completion_choices(CompletionRequest(model="m", prompt=[1, 2, 3], **body))
    assert len(choices) == SURFACE["n"].value  # the one field the router fans out instead of sending
    pb = choices[0].request.params
    sent = {name for name in where("proto") if not pb.DESCRIPTOR.fields_by_name[name].has_presence or pb.HasField(name)}
    assert sent == where("proto")
    params = params_from_pb(pb)
    assert {name: getattr(params, name) for name in where("proto")} == {n: _engine_value(n) for n in where("proto")}


def _line(body: dict) -> str:
    return json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1], **body}})


def test_the_batch_job_runs_its_fields_and_refuses_the_others(builder) -> None:
    runs = where("batch")
    item = parse_line(_line({name: SURFACE[name].value for name in runs}), builder, "m")
    assert {name: getattr(params_from_pb(item.choice.request.params), name) for name in runs} == {
        n: _engine_value(n) for n in runs
    }
    for name in where("http") - runs:
        with pytest.raises(LineError) as err:
            parse_line(_line({name: SURFACE[name].value}), builder, "m")
        assert (err.value.code, err.value.param) == ("unsupported_parameter", name)
