"""The chat-template environment matches transformers': strftime_now (Llama 3.x), raise_exception,
tools/documents, {% generation %}, the immutable sandbox; --chat-template as a file or inline."""

from __future__ import annotations

import shutil
from datetime import datetime

import pytest

from pdserve.engine.chat_template import load_chat_template
from pdserve.engine.tokenizer import Tokenizer

LLAMA3_STYLE = (
    "{{- bos_token }}"
    '{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}'
    '{{- "Today Date: " + date_string + "\\n" }}'
    "{%- if tools is not none %}{{- 'Tools: ' }}{% for t in tools %}{{- t | tojson }}{% endfor %}{%- endif %}"
    "{%- if documents %}{{- 'Docs: ' + documents | length | string }}{%- endif %}"
    '{{- "<|eot_id|>" }}'
    "{%- for message in messages %}"
    "{%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('roles must be user or assistant') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{- message['content'] | trim }}{% endgeneration %}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir, chat_template=LLAMA3_STYLE)


def test_llama3_style_template_prints_todays_date_and_tools(tok):
    text = tok.apply_chat_template([{"role": "user", "content": " hi "}], tools=[{"name": "f"}])
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text
    assert 'Tools: {"name": "f"}' in text
    assert text.endswith("user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Docs: 2" in tok.apply_chat_template([{"role": "user", "content": "x"}], documents=[{}, {}])
    assert tok.encode_chat([{"role": "user", "content": "hi"}])  # tokenizes what it renders


def test_raise_exception_and_sandbox_violations_are_value_errors(tok, tiny_model_dir):
    with pytest.raises(ValueError, match="roles must be user or assistant"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    mutating = Tokenizer(tiny_model_dir, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="unsafe|not safely|immutable"):
        mutating.apply_chat_template([{"role": "user", "content": "x"}])
    escaping = Tokenizer(tiny_model_dir, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        escaping.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_flag_reads_a_file_or_takes_the_template(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text(LLAMA3_STYLE)
    assert load_chat_template(str(file)) == LLAMA3_STYLE
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="neither a readable file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for %}")


def test_the_checkpoints_own_template_is_used_without_the_flag(tiny_model_dir, tmp_path):
    own = Tokenizer(tiny_model_dir)
    assert "<|im_start|>" in own.apply_chat_template([{"role": "user", "content": "x"}])
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="--chat-template"):
        Tokenizer(bare).apply_chat_template([{"role": "user", "content": "x"}])
