"""Structured outputs: what a request's text must match (`GrammarSpec`) and its grammar.

The grammar engine is xgrammar, imported lazily: the engine runs without it, and a request that
asks for structured output is then refused with a ValueError saying so (a 400 / INVALID_ARGUMENT).
`build_grammar` needs no tokenizer, so a front end checks a spec cheaply before any node sees it;
`engine.grammar_cache.GrammarCache` compiles it against a vocabulary into token masks.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""json_schema: `spec` is a JSON Schema (JSON text); json_object: any JSON object (`spec` empty);
regex: a regular expression; choice: a JSON array of the allowed strings; grammar: EBNF (GBNF)."""
MAX_SPEC_BYTES = 65536
"""Largest spec accepted (the wire bound of SamplingParams.structured_outputs.spec)."""
MAX_CHOICES = 1024
_ANY_OBJECT = '{"type": "object"}'
_ENGINE_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


class GrammarSpec(NamedTuple):
    """A structured-output request: the kind of constraint and its text (see KINDS)."""

    kind: str
    spec: str = ""
    generated_token_ids: tuple[int, ...] = ()
    """Tokens already generated under this grammar elsewhere (a migrated stream): the grammar
    starts after them. Not part of what is compiled (`key`)."""

    @property
    def key(self) -> GrammarSpec:
        """What the compiled grammar depends on: the kind and the text."""
        return GrammarSpec(self.kind, self.spec) if self.generated_token_ids else self


class GrammarUnavailable(ValueError):
    """Structured output was asked for, but the grammar engine (xgrammar) is not installed."""


def xgrammar_module() -> Any:
    """The xgrammar module (typed Any: the engine type-checks without it); GrammarUnavailable when
    it is not installed."""
    try:
        import xgrammar
    except ImportError:
        raise GrammarUnavailable(
            "structured outputs need the grammar engine xgrammar, which is not installed here (pip install xgrammar)"
        ) from None
    return xgrammar


def check_spec(spec: GrammarSpec) -> None:
    """ValueError naming what is wrong with the spec's shape (before any grammar is built)."""
    if spec.kind not in KINDS:
        raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if len(spec.spec.encode()) > MAX_SPEC_BYTES:
        raise ValueError(f"a structured output spec is at most {MAX_SPEC_BYTES} bytes")
    if spec.kind == "json_object" and spec.spec:
        raise ValueError("json_object takes no spec")
    if spec.kind in ("regex", "grammar") and not spec.spec:
        raise ValueError(f"the {spec.kind} must not be empty")


def build_grammar(spec: GrammarSpec) -> Any:
    """The spec as a tokenizer-free xgrammar Grammar; ValueError with a clear message when the
    schema, regex, choice list or EBNF is invalid (or the engine is missing).

    JSON is generated without free whitespace between tokens (`any_whitespace=False`): a weak model
    given free whitespace can spend its whole token budget on it."""
    check_spec(spec)
    xgr = xgrammar_module()
    try:
        if spec.kind == "json_schema":
            schema = _loads(spec.spec, "json_schema")  # a clearer message than the engine's for text that is not JSON
            return xgr.Grammar.from_json_schema(
                json.dumps(bounded_strings_as_patterns(schema)), any_whitespace=False, strict_mode=True
            )
        if spec.kind == "json_object":  # strict_mode off: an object may have any properties
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.spec))
        return xgr.Grammar.from_ebnf(spec.spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (from C++) for a bad schema, regex or EBNF
        raise ValueError(f"invalid {spec.kind}: {_ENGINE_NOISE.sub('', str(e)).strip()}") from None


def bounded_strings_as_patterns(schema: object) -> object:
    """The schema with each length-bounded string (minLength/maxLength, no pattern or format) given
    the equivalent `pattern` over plain characters instead. xgrammar 0.2's rule for such strings
    lets raw control characters through, which no JSON parser accepts; its pattern rule does not.
    The output still matches the original schema (the pattern only narrows it: no escapes)."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    low, high = out.get("minLength", 0), out.get("maxLength", "")
    bounded = "minLength" in out or "maxLength" in out
    plain = out.get("type") == "string" and "pattern" not in out and "format" not in out
    if plain and bounded and type(low) is int and type(high) in (int, str):  # else xgrammar names the error
        out.pop("minLength", None), out.pop("maxLength", None)  # in the pattern now (xgrammar warns about both)
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return out


def choice_ebnf(choices_json: str) -> str:
    """EBNF whose language is exactly the given strings (a JSON array of non-empty strings)."""
    choices = _loads(choices_json, "choice")
    if (
        not isinstance(choices, list)
        or not choices
        or len(choices) > MAX_CHOICES
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    # an EBNF string literal escapes like a JSON string (quotes, backslashes, control characters)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _loads(text: str, kind: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"invalid {kind}: not JSON ({e})") from None
