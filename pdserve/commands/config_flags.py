"""Flags generated from config dataclass fields: one declaration per setting, as vLLM's arg_utils does.

A config field documented by the string literal under it (the house style for dataclass fields)
becomes a flag with `config_flag(parser, Config, "field")`: `--field-name`, its help the field's
docstring followed by the field's real default (an unset one, None or empty, is explained by the
docstring itself), its type taken from that default (or from an `int | None` annotation). The
flag's own default is None, so an unset flag leaves the dataclass default in force (`flag_values`
in `pdserve.node_runtime.config` builds the config from the set ones), and PDSERVE_* variables and
`--config FILE.yaml` reach it like any other flag. Help text and default cannot drift apart: both
are read from the one field.

A flag with no field behind it (how many nodes `pdserve up` starts) is a `plain_flag`, whose help
states the parser default from the same value; `tests/pdserve/test_help_defaults.py` holds every
stated default of every command to the value the command really takes.
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


def field_of(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def field_default(cls: type, name: str) -> Any:
    """The default a config takes for field `name` when no flag sets it."""
    field = field_of(cls, name)
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


_FIELD: Any = object()
"""`stated_default` left out: the help states the field's own default."""


def config_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    name: str,
    *flags: str,
    type: Callable[[str], Any] | None = None,
    stated_default: Any = _FIELD,
    keep_default: bool = False,
    **kwargs: Any,
) -> argparse.Action:
    """Declare the flag of `cls.name` (`flags`: its option strings, default `--name-with-dashes`);
    other argparse keywords (dest, choices, metavar, nargs, an `action` such as store_true) pass
    through. A field without a docstring is a TypeError: its help would have nothing to say.

    `stated_default`: what the help gives as the default where the command's differs from the
    field's (a role's own port, a value per node role); None leaves it to the docstring.
    `keep_default`: the parser's default is the field's default itself, for a command that reads
    the namespace directly instead of building the config through `flag_values`.
    The action remembers its field as `config_field` (cls, name)."""
    doc = field_docs(cls).get(name)
    if doc is None:
        raise TypeError(f"{cls.__name__}.{name} has no docstring to become its flag's help")
    default = field_default(cls, name)
    if "action" not in kwargs:  # store_true and BooleanOptionalAction take no value, hence no type
        kwargs["type"] = type or (
            on_off if isinstance(default, bool) else builtin_type(default, field_of(cls, name).type)
        )
        if kwargs["type"] is on_off:
            kwargs.setdefault("metavar", "on|off")
    kwargs.setdefault("dest", name)
    help_text = with_default(doc, default if stated_default is _FIELD else stated_default)
    action = parser.add_argument(
        *(flags or (f"--{name.replace('_', '-')}",)),
        default=default if keep_default else None,
        help=help_text,
        **kwargs,
    )
    setattr(action, "config_field", (cls, name))
    return action


def with_default(text: str, default: Any) -> str:
    """Help `text` followed by `default` as the user writes it, `(default X)`; an unset default
    (None, or an empty string or tuple) is the text's to explain. %-escaped: argparse %-formats help."""
    unset = default is None or (isinstance(default, (str, tuple)) and not default)
    stated = text if unset else f"{text.rstrip('.')} (default {shown(default)})"
    return stated.replace("%", "%%")


def plain_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, default: Any, help: str, **kwargs: Any
) -> argparse.Action:
    """A flag with no config field behind it (a process-shape setting of one command): its help
    states the parser default it is given, from the same value."""
    return parser.add_argument(*flags, default=default, help=with_default(help, default), **kwargs)


def builtin_type(default: Any, annotation: object = None) -> Callable[[str], Any]:
    """The argparse type for a field whose default is `default`: its class for a number, else the
    number type an optional field is annotated with (`int | None`), else str."""
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default.__class__
    if default is None:
        optional = {f"{t.__name__} | None": t for t in (int, float)}
        return optional.get(str(annotation), str)
    return str
