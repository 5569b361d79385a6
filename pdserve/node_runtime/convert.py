"""Conversions between the wire (pdserve.v1 protobuf) and engine types, with every bound checked.

The engine never sees a *_pb2 type; the node servicers call only these functions.
"""

from __future__ import annotations

import re
from typing import Any

from pdserve.engine.grammar import MAX_SPEC_BYTES, GrammarSpec
from pdserve.engine.kv_namespace import MAX_CACHE_SALT_BYTES
from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pdserve.v1 import common_pb2

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PREFILL_ADDRESSES = 8
MAX_GENERATED_TOKENS = 65536
"""Most tokens a migrated structured-output stream replays into its grammar (convert.grammar_spec_from_pb)."""


def check_request_id(request_id: str) -> str:
    if not REQUEST_ID.match(request_id):
        raise ValueError("request_id must be 1-128 characters of [A-Za-z0-9._:-]")
    return request_id


def cache_salt_from_pb(message) -> str | None:
    """The optional `cache_salt` of a GenerateRequest or PrefillRequest; ValueError when too long."""
    if not message.HasField("cache_salt"):
        return None
    if len(message.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes")
    return message.cache_salt


def params_from_pb(p: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams from the wire; ValueError (-> INVALID_ARGUMENT) for anything out of bounds.

    The proto mirrors SamplingParams field for field, so this copies every field by name rather
    than listing them again: a set field (or a plain proto3 scalar) is passed on, an unset
    `optional` one leaves the engine's default."""
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s.encode()) > MAX_STOP_BYTES for s in p.stop):
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_BYTES} bytes")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:  # before copying a huge map
        raise ValueError(f"invalid sampling parameter logit_bias: at most {MAX_LOGIT_BIAS} entries")
    if not p.HasField("max_tokens"):  # decode nodes reserve KV for every token a request may generate
        raise ValueError("invalid sampling parameter max_tokens: it is required")
    values: dict[str, Any] = {}
    for f in p.DESCRIPTOR.fields:
        if f.has_presence and not p.HasField(f.name):
            continue
        value = getattr(p, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = tuple(value.items())  # logit_bias: (token id, bias) pairs
        elif f.message_type is not None:  # structured_outputs, the one message field
            value = grammar_spec_from_pb(value)
        values[f.name] = tuple(value) if f.is_repeated else value
    return SamplingParams(**values)


def grammar_spec_from_pb(pb: common_pb2.StructuredOutputs) -> GrammarSpec:
    if len(pb.spec) > MAX_SPEC_BYTES:  # characters, a cheap first bound; SamplingParams checks bytes
        raise ValueError(f"invalid sampling parameter structured_outputs: at most {MAX_SPEC_BYTES} bytes")
    if len(pb.generated_token_ids) > MAX_GENERATED_TOKENS:  # the engine thread replays each one
        raise ValueError(f"structured_outputs.generated_token_ids: at most {MAX_GENERATED_TOKENS} tokens")
    return GrammarSpec(pb.kind, pb.spec, tuple(pb.generated_token_ids))


def logprob_to_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    )


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.logprob, [(t.token_id, t.logprob) for t in pb.top])
