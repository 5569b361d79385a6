"""Every default a flag's help text states is the default the command really takes: the value in the
config the command builds from no flags at all (issue 48: `--local-prefill-max-tokens` said 16 on
`up` and `decode` while the default was 64). `up` hands its node and router flags on, so its help is
checked against a decode node's and a router's config."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from pdserve.cli import build_parser
from pdserve.commands.node_common import node_config
from pdserve.commands.router import router_config

STATED = re.compile(r"(?:\(|; |, )default:? ([^;),]+)")
LITERAL = re.compile(r"^[\w.:-]+$")


def _flatten(obj, out: dict) -> dict:
    """field name -> value over a config and the configs inside it (the first of a name wins)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _flatten(value, out)
        else:
            out.setdefault(f.name, value)
    return out


def _configs() -> dict[str, dict]:
    parser = build_parser()
    decode = _flatten(node_config(parser.parse_args(["decode"]), "decode"), {})
    router = _flatten(router_config(parser.parse_args(["router"])), {})
    return {
        "prefill": _flatten(node_config(parser.parse_args(["prefill"]), "prefill"), {}),
        "decode": decode,
        "router": router,
        "up": {**router, **decode},
    }


def _stated(command: str) -> list[tuple[str, str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for action in sub.choices[command]._actions:
        m = STATED.search(action.help or "")
        if m and LITERAL.match(m.group(1).strip()):
            found.append((action.dest, m.group(1).strip()))
    return found


def _same(stated: str, value: object) -> bool:
    if isinstance(value, bool):
        return stated == ("on" if value else "off")
    if isinstance(value, (int, float)):
        try:
            return float(stated) == float(value)
        except ValueError:
            return False
    return stated.lower() == str(value).lower()


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "up"])
def test_every_stated_default_is_the_real_one(command, monkeypatch):
    for var in ("PDSERVE_DEVICE", "PDSERVE_ATTENTION_BACKEND", "POD_IP"):
        monkeypatch.delenv(var, raising=False)
    config = _configs()[command]
    checked, wrong = 0, []
    for dest, stated in _stated(command):
        if config.get(dest) is None:
            continue  # not a config field (a process flag such as --port of `up`), or no single value
        checked += 1
        if not _same(stated, config[dest]):
            wrong.append(f"--{dest.replace('_', '-')}: help says {stated!r}, the default is {config[dest]!r}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 5, f"only {checked} stated defaults were checked for {command}"


def test_the_check_sees_a_wrong_default():
    assert not _same("16", 64) and _same("64", 64) and _same("on", True) and not _same("off", True)
    assert _same("30", 30.0) and _same("kv-aware", "kv-aware") and not _same("tcp", "rdma")
