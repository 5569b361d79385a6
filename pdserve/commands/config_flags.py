"""Flags generated from config dataclass fields: one declaration per setting, as vLLM's arg_utils does.

A config field documented by the string literal under it (the house style for dataclass fields)
becomes a flag with `config_flag(parser, Config, "field")`: `--field-name`, its help the field's
docstring followed by the field's real default (a None default is explained by the docstring
itself), its type taken from that default. The flag's own
default is None, so an unset flag leaves the dataclass default in force (`flag_values` in
`pdserve.node_runtime.config` builds the config from the set ones), and PDSERVE_* variables and
`--config FILE.yaml` reach it like any other flag. Help text and default cannot drift apart: both
are read from the one field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Callable


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it), over the class and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in zip(body.body, body.body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_default(cls: type, name: str) -> Any:
    """The default a config takes for field `name` when no flag sets it."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default: it cannot be an optional flag")


def on_off(value: str) -> bool:
    """argparse type of an on|off flag."""
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def shown(value: Any) -> str:
    """A default as the user writes it on the command line."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "unset"
    return str(value)


def config_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    name: str,
    *flags: str,
    type: Callable[[str], Any] | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Declare the flag of `cls.name` (`flags`: its option strings, default `--name-with-dashes`);
    other argparse keywords (choices, metavar) pass through. A field without a docstring is a
    TypeError: its help would have nothing to say."""
    doc = field_docs(cls).get(name)
    if doc is None:
        raise TypeError(f"{cls.__name__}.{name} has no docstring to become its flag's help")
    default = field_default(cls, name)
    if type is None:
        type = on_off if isinstance(default, bool) else builtin_type(default)
    if type is on_off:
        kwargs.setdefault("metavar", "on|off")
    # a field whose default is None says in its docstring what None means
    stated = doc if default is None else f"{doc.rstrip('.')} (default {shown(default)})"
    help_text = stated.replace("%", "%%")  # argparse %-formats help
    return parser.add_argument(
        *(flags or (f"--{name.replace('_', '-')}",)), dest=name, default=None, type=type, help=help_text, **kwargs
    )


def builtin_type(default: Any) -> Callable[[str], Any]:
    """The argparse type for a field whose default is `default` (str for None and strings)."""
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default.__class__
    return str
