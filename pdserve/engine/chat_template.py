"""The chat-template environment, as transformers builds it (`render_jinja_template`), and
`--chat-template` (a file or the template itself, as vLLM reads it).

A template comes from the checkpoint or the command line, so it is treated as untrusted code: it runs
in jinja2's ImmutableSandboxedEnvironment (no attribute access to internals, no mutation of the
objects passed in). Its globals are transformers': `raise_exception`, `strftime_now` (Llama 3.x
templates print today's date with it), a `tojson` filter with json.dumps' arguments, loop controls
and the `{% generation %}` block (rendered as its body: it only marks assistant text for training).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

_TEMPLATE_CHARS = set("{}\n")
"""A --chat-template value with any of these is a template; vLLM tells file from text the same way."""


def raise_exception(message: str) -> None:
    """Templates call this to refuse a conversation (e.g. roles that do not alternate)."""
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt: str) -> str:
    """The current local time formatted with strftime (transformers' global of the same name)."""
    return datetime.now().strftime(fmt)


def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers' AssistantTracker also
    records where it is, which only training masks need)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def compile_template(template: str) -> jinja2.Template:
    """A template compiled in transformers' sandboxed environment; TemplateSyntaxError if malformed."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def load_chat_template(value: str) -> str:
    """`--chat-template`: the contents of a file, or the value itself when it reads as a template.
    ValueError for a path that cannot be read or a template that does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --chat-template {value}: {e}") from None
    elif _TEMPLATE_CHARS & set(value):
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a readable file nor a template")
    try:
        compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return template
