"""CLI plumbing: every subcommand registers, and nodes advertise a reachable address."""

from __future__ import annotations

import argparse
import socket

import pytest

from pdserve.cli import COMMANDS, build_parser
from pdserve.commands.node_common import advertise_host


def test_every_command_has_help(capsys):
    parser = build_parser()
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([name.replace("_", "-"), "--help"])
        assert exit_.value.code == 0
    assert "up" in capsys.readouterr().out


def test_advertise_host(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    ns = lambda **kw: argparse.Namespace(**{"advertise_host": None, "host": "127.0.0.1", **kw})  # noqa: E731
    assert advertise_host(ns()) == "127.0.0.1"
    assert advertise_host(ns(host="0.0.0.0")) == socket.gethostname()
    assert advertise_host(ns(advertise_host="node-a")) == "node-a"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertise_host(ns(host="0.0.0.0")) == "10.1.2.3"
