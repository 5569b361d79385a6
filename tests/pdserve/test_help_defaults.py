"""Every default a flag's help states, in every `pdserve` command, is the value the command really
takes when the flag is unset (issue 48: `--local-prefill-max-tokens` said 16 on `up` and `decode`
while the default was 64).

What a flag really yields unset, first match wins: the parser's own default; for the serving
commands, the value in the config they build from no flags at all (`up` hands its node and router
flags on, so its help is checked against a decode node's and a router's config); for a flag
generated from a config field (`config_flag`), that field's default; else a default the command
applies in code, named below by the constant the code uses. A stated default none of these
explains fails the test, as does one that differs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest

from pdserve.cli import build_parser
from pdserve.commands.batch import DEFAULT_STAGES
from pdserve.commands.config_flags import field_default, shown
from pdserve.commands.memory_args import OFFLOADING_BACKENDS
from pdserve.commands.node_common import node_config
from pdserve.commands.router import router_config
from pdserve.commands.simulate import DEFAULT_POLICIES
from pdserve.engine.hf_cache import DEFAULT_REVISION

STATED = re.compile(r"(?:^|\(|[;,] )default:? ([^;)]+)|([\w.:+-]+) \(default\)")
"""`(default X)`, `(default: X)`, `; default X`, a help that starts `default X`, and `X (default)`."""
LITERAL = re.compile(r"^(?!-)[\w.:+/-]+(?:, (?!-)[\w.:+/-]+)*$")
"""A value or a list of values (`td-pipe, pp+sb`), not a description (`the model's own`, `--model`)."""
CODE_DEFAULTS = {
    "revision": DEFAULT_REVISION,  # hf_cache: a Hub id without --revision
    "kv_offloading_backend": OFFLOADING_BACKENDS[0],  # the one host tier, nothing reads the flag
    "stages": DEFAULT_STAGES,  # `batch` without --external-stages
    "policy": DEFAULT_POLICIES,  # `simulate`: every policy
}
"""Defaults applied in a command's code (dest -> the constant it uses)."""
RESOLVED_AT_START = {"attention_backend"}
"""Fields a serving command's config holds resolved for this machine (auto -> cpu_paged), not as defaulted."""


def _flatten(obj, out: dict) -> dict:
    """field name -> value over a config and the configs inside it (the first of a name wins)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _flatten(value, out)
        else:
            out.setdefault(f.name, value)
    return out


def _built_configs(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """The config each serving command builds from no flags, flattened."""
    decode = _flatten(node_config(parser.parse_args(["decode"]), "decode"), {})
    router = _flatten(router_config(parser.parse_args(["router"])), {})
    prefill = _flatten(node_config(parser.parse_args(["prefill"]), "prefill"), {})
    return {"prefill": prefill, "decode": decode, "router": router, "up": {**router, **decode}}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _stated(action: argparse.Action) -> list[str]:
    """The literal defaults `action`'s help states (descriptions such as `the model's own` are skipped)."""
    found = []
    for m in STATED.finditer(action.help or ""):
        value = (m.group(1) or m.group(2)).strip()
        if LITERAL.match(value):
            found.append(value)
    return found


def _real(command: str, action: argparse.Action, built: dict[str, dict], used: set[str]) -> tuple[str, object]:
    """(where it comes from, the value) the flag really takes unset; ("", None) when nothing says."""
    if action.default is not None:
        return "the parser's default", action.default
    value = None if action.dest in RESOLVED_AT_START else built.get(command, {}).get(action.dest)
    if value is not None:
        return f"the config `{command}` builds", value
    field = getattr(action, "config_field", None)
    if field is not None and field_default(*field) is not None:
        return f"{field[0].__name__}.{field[1]}", field_default(*field)
    if action.dest in CODE_DEFAULTS:
        used.add(action.dest)
        return "the command's code", CODE_DEFAULTS[action.dest]
    return "", None


def _same(stated: str, value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return stated == ", ".join(map(shown, value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(stated) == float(value)
        except ValueError:
            return False
    return stated == shown(value)


@pytest.fixture
def clean_env(monkeypatch):
    """No PDSERVE_* variable (nor POD_IP) of the machine running the tests reaches the parsers."""
    for var in [v for v in os.environ if v.startswith("PDSERVE_")] + ["POD_IP"]:
        monkeypatch.delenv(var, raising=False)


def test_every_stated_default_of_every_command_is_the_real_one(clean_env):
    parser = build_parser()
    built = _built_configs(parser)
    checked: dict[str, int] = {}
    wrong, unexplained, used = [], [], set()
    for command, sub in _commands(parser).items():
        checked[command] = 0
        for action in sub._actions:
            flag = (action.option_strings or [action.dest])[-1]
            for stated in _stated(action):
                source, value = _real(command, action, built, used)
                if not source:
                    unexplained.append(f"{command} {flag}: help says default {stated!r}, but unset it is None")
                elif not _same(stated, value):
                    wrong.append(f"{command} {flag}: help says default {stated!r}, {source} is {value!r}")
                checked[command] += 1
    assert not wrong, "\n".join(wrong)
    assert not unexplained, "\n".join(unexplained)
    assert used == set(CODE_DEFAULTS), f"CODE_DEFAULTS entries no help states: {set(CODE_DEFAULTS) - used}"
    # not vacuous: every command was looked at, and most flags state their default
    assert set(checked) == {
        "generate",
        "make-tiny-model",
        "prefill",
        "decode",
        "router",
        "up",
        "simulate",
        "plan",
        "stage",
        "batch",
    }
    assert all(checked.values()), f"commands with no stated default checked: {checked}"
    assert sum(checked.values()) >= 150, f"only {sum(checked.values())} stated defaults were checked: {checked}"


def test_the_check_sees_a_wrong_default():
    assert not _same("16", 64) and _same("64", 64) and _same("on", True) and not _same("off", True)
    assert _same("30", 30.0) and _same("kv-aware", "kv-aware") and not _same("tcp", "rdma")
    assert _same("td-pipe, pp+sb", ("td-pipe", "pp+sb")) and not _same("INFO", "info")
    help_text = "a (default 16); b (default: on), default x; c (default: the model's own); auto (default): d"
    action = argparse.ArgumentParser().add_argument("--x", help=help_text)
    assert _stated(action) == ["16", "on", "x", "auto"]  # a description (the model's own) is no value
