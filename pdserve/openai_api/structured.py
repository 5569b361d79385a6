"""Structured-output request fields -> the one constraint a request's text must match.

Three spellings ask for the same thing: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be set. The
spec is checked here, by building its grammar (engine.grammar), so a bad schema or regex is a
400 naming the field at the front end, never an error deep in a node.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pdserve.engine.grammar import GrammarSpec, build_grammar
from pdserve.openai_api.errors import BadRequest
from pdserve.openai_api.protocol import SamplingFields
from pdserve.v1 import common_pb2

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""The request fields that set structured output, in the order they are read."""
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def structured_outputs_of(req: SamplingFields) -> common_pb2.StructuredOutputs | None:
    """The request's constraint for the wire, or None for free text; BadRequest (400 naming the
    field) when it is malformed, invalid, or set twice."""
    found = [(name, getattr(req, name)) for name in FIELDS if getattr(req, name) is not None]
    found = [(n, v) for n, v in found if not (n == "response_format" and v.get("type") == "text")]
    if not found:
        return None
    if len(found) > 1:
        raise BadRequest(
            f"set only one of {found[0][0]} and {found[1][0]} (both ask for structured output)", found[1][0]
        )
    name, value = found[0]
    spec, param = _spec(name, value)
    try:
        _check(spec)
    except ValueError as e:
        raise BadRequest(f"{param}: {e}", param) from None
    return common_pb2.StructuredOutputs(kind=spec.kind, spec=spec.spec)


@functools.lru_cache(maxsize=256)
def _check(spec: GrammarSpec) -> None:
    """Cached by spec: clients send one schema over and over (a failure is not cached)."""
    build_grammar(spec)


def _spec(name: str, value: Any) -> tuple[GrammarSpec, str]:
    """The GrammarSpec a field's value asks for, and the parameter to name in errors."""
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        keys = sorted(value)
        if len(keys) != 1 or keys[0] not in (*_VLLM_KEYS, "json_object"):
            raise BadRequest(
                "structured_outputs takes exactly one of json, regex, choice, grammar or json_object "
                f"(got {', '.join(keys) or 'none'})",
                "structured_outputs",
            )
        key = keys[0]
        if key == "json_object":
            if value[key] is not True:
                raise BadRequest("structured_outputs.json_object must be true", "structured_outputs.json_object")
            return GrammarSpec("json_object"), "structured_outputs.json_object"
        return _typed(_VLLM_KEYS[key], value[key], f"structured_outputs.{key}"), f"structured_outputs.{key}"
    return _typed(_GUIDED_KINDS.get(name, "grammar"), value, name), name


def _response_format(value: dict) -> tuple[GrammarSpec, str]:
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return GrammarSpec("json_object"), "response_format"
    if kind != "json_schema":
        raise BadRequest(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format.type"
        )
    inner = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(inner, dict):
        raise BadRequest("response_format of type json_schema needs a json_schema object", "response_format")
    unknown = sorted(set(inner) - _JSON_SCHEMA_KEYS)
    if unknown or not isinstance(inner.get("schema"), dict) or not isinstance(inner.get("strict", False), bool):
        raise BadRequest(
            "response_format.json_schema takes name, description, strict (a boolean) and schema (an object)"
            + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
            "response_format.json_schema",
        )
    # strict or not, the schema is enforced token by token (extra properties never generated)
    return GrammarSpec("json_schema", json.dumps(inner["schema"])), "response_format.json_schema.schema"


def _typed(kind: str, value: Any, param: str) -> GrammarSpec:
    """A vLLM-style value: a JSON schema (object or JSON text), a choice list, or a string."""
    if kind == "json_schema" and isinstance(value, (dict, str)):
        return GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value))
    if kind == "choice" and isinstance(value, list):
        return GrammarSpec(kind, json.dumps(value))
    if kind in ("regex", "grammar") and isinstance(value, str):
        return GrammarSpec(kind, value)
    want = {"json_schema": "a JSON schema", "choice": "a list of strings"}.get(kind, "a string")
    raise BadRequest(f"{param} must be {want}", param)
