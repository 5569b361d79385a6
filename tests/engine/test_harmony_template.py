"""A harmony-style chat template (the format of gpt-oss checkpoints' chat_template.jinja) through the
engine's template code and the router's /tokenize: the template here is written for this test, but
uses the jinja features gpt-oss's own relies on (recursive macros, `namespace` with attribute
assignment, the `items` and `tojson` filters, `strftime_now`, `raise_exception`, string methods,
loop controls, template variables with defaults). Rendered text must equal transformers' rendering
(`render_jinja_template`) of the same conversation."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.errors import BadRequest
from pdserve.openai_api.tokenize import TokenizeRequest, tokenize

HARMONY_STYLE = """\
{#- harmony-style test template: gpt-oss's jinja features, its own text -#}
{%- macro ts_type(spec) -%}
    {%- if spec.enum is defined -%}{{ spec.enum | map("tojson") | join(" | ") }}
    {%- elif spec.type == "array" -%}{{ ts_type(spec["items"]) }}[]
    {%- elif spec.type == "object" and spec.properties is defined -%}
        {{ "{ " }}{%- for key, value in spec.properties | items -%}
            {{ key }}{{ "" if key in spec.required | default([]) else "?" }}: {{ ts_type(value) }}
            {{- ", " if not loop.last }}
        {%- endfor %}{{ " }" }}
    {%- elif spec.type in ["integer", "number"] -%}number
    {%- else -%}{{ spec.type }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(developer=none, seen_user=false) -%}
{%- if messages and messages[0].role in ["system", "developer"] -%}
    {%- set ns.developer = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
<|start|>system<|message|>You are a test assistant.
Current date: {{ strftime_now("%Y-%m-%d") }}

Reasoning: {{ reasoning_effort | default("medium") }}<|end|>
{%- if ns.developer is not none or tools -%}
    <|start|>developer<|message|>
    {%- if ns.developer is not none %}# Instructions

{{ ns.developer | trim }}
    {%- endif -%}
    {%- if tools %}

namespace functions {
        {%- for tool in tools -%}
            {%- set fn = tool.function if tool.function is defined else tool %}
// {{ fn.description | trim }}
type {{ fn.name }} = (_: {{ ts_type(fn.parameters) }}) => any;
// schema: {{ fn.parameters | tojson(sort_keys=true) }}
        {%- endfor %}
}
    {%- endif -%}
    <|end|>
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message.role in ["system", "developer"] -%}
        {{- raise_exception("a " ~ message.role ~ " message may only come first") -}}
    {%- elif message.role == "assistant" -%}
        {%- if not ns.seen_user -%}
            {{- raise_exception("the conversation must start with a user message") -}}
        {%- endif -%}
        {%- set parts = message.content.split("<|channel|>final<|message|>") -%}
        {%- if parts | length > 1 -%}
            <|start|>assistant<|channel|>final<|message|>{{ parts[-1] | trim }}<|end|>
        {%- else -%}
            <|start|>assistant<|channel|>final<|message|>{{ message.content | trim }}<|end|>
        {%- endif -%}
    {%- elif message.role == "tool" -%}
        <|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>
    {%- else -%}
        {%- set ns.seen_user = true -%}
        {%- if message.content.startswith("/") -%}{% continue %}{%- endif -%}
        <|start|>user<|message|>{{ message.content }}<|end|>
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": " Weather at a place. ",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [
    {"role": "developer", "content": "  Answer briefly.  "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "user", "content": "/skip this one"},
    {"role": "assistant", "content": "<|channel|>analysis<|message|>look it up<|channel|>final<|message|> Sunny."},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture
def harmony(tiny_model_dir, tmp_path) -> Tokenizer:
    """The tiny checkpoint with the template shipped as chat_template.jinja (as gpt-oss ships it),
    tokenizer_config.json holding none."""
    path = tmp_path / "harmony"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(HARMONY_STYLE)
    return Tokenizer(path)


def _transformers(tok: Tokenizer, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[MESSAGES],
        chat_template=HARMONY_STYLE,
        add_generation_prompt=True,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        **kwargs,
    )
    return rendered[0]


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS, "reasoning_effort": "high"}])
def test_renders_as_transformers_does(harmony, kwargs):
    text = harmony.apply_chat_template(MESSAGES, **kwargs)
    assert text == _transformers(harmony, **kwargs)
    assert f"Current date: {datetime.now().strftime('%Y-%m-%d')}\n" in text
    assert "# Instructions\n\nAnswer briefly." in text and "/skip" not in text
    assert "final<|message|>Sunny.<|end|>" in text and '<|message|>"{\\"temp\\": 21}"<|end|>' in text
    assert text.endswith("<|start|>user<|message|>And tomorrow?<|end|><|start|>assistant")
    if kwargs:
        assert "Reasoning: high" in text
        assert (
            'type get_weather = (_: { city: string, unit?: "celsius" | "fahrenheit", days?: number[] }) => any;' in text
        )
        assert '// schema: {"properties": {"city"' in text


def test_the_router_tokenizes_what_the_template_renders(harmony):
    req = TokenizeRequest(messages=MESSAGES, tools=TOOLS)
    answer = tokenize(harmony, req, max_model_len=4096)
    assert answer["tokens"] == harmony.encode(_transformers(harmony, tools=TOOLS), add_special_tokens=False)
    # a chat completion (openai_api.choices) renders through encode_chat: the same ids as /tokenize
    plain = tokenize(harmony, TokenizeRequest(messages=MESSAGES), max_model_len=4096)
    assert plain["tokens"] == harmony.encode_chat(MESSAGES)


def test_raise_exception_in_the_template_is_a_400(harmony):
    late = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ValueError, match="a system message may only come first"):
        harmony.apply_chat_template(late)
    with pytest.raises(BadRequest, match="cannot apply the chat template: a system message may only come first"):
        tokenize(harmony, TokenizeRequest(messages=late), max_model_len=4096)
    with pytest.raises(ValueError, match="must start with a user message"):
        harmony.apply_chat_template([{"role": "assistant", "content": "x"}])
