"""JSON schemas for the structured-output tests (HTTP and batch), and the validity check.

Each schema bounds what a random-weight model could otherwise grow without end (string lengths,
number ranges, array sizes), so that every constrained output finishes inside max_tokens and must
be valid; free generation from the same prompts almost never is."""

from __future__ import annotations

import json

import jsonschema

SCHEMAS: dict[str, dict] = {
    "person": {  # strict: enums, a bounded string, an array of enums, no extra properties
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
    "nested": {  # objects in objects, a boolean, a pattern
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "active": {"type": "boolean"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "active", "address"],
                "additionalProperties": False,
            },
            "kind": {"enum": ["a", "b", "c"]},
        },
        "required": ["user", "kind"],
        "additionalProperties": False,
    },
    "points": {  # a top-level array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "optional": {  # optional properties, null in an enum
        "type": "object",
        "properties": {"label": {"enum": ["x", "y", None]}, "score": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["score"],
        "additionalProperties": False,
    },
}
PROMPTS = ["The old lighthouse keeper", "Once upon a time", "Data:", "A quick brown fox"]


def is_valid(text: str, schema: dict) -> bool:
    """Whether `text` is JSON (strict: no raw control characters) that `schema` accepts."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
