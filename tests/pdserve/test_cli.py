"""CLI plumbing: every subcommand registers, and nodes advertise a reachable address."""

from __future__ import annotations

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
    assert advertise_host(None, "127.0.0.1") == "127.0.0.1"
    assert advertise_host(None, "0.0.0.0") == socket.gethostname()
    assert advertise_host("node-a", "127.0.0.1") == "node-a"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertise_host(None, "0.0.0.0") == "10.1.2.3"


def test_api_keys_come_from_flags_files_and_env_so_they_can_stay_out_of_ps(tmp_path, monkeypatch):
    from pdserve.commands.router import api_keys

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    keyfile = tmp_path / "keys"
    keyfile.write_text("# router keys\nfile-key-1\n\n  file-key-2  \n")
    args = build_parser().parse_args(["router", "--api-key-file", str(keyfile)])
    assert api_keys(args) == ["file-key-1", "file-key-2"]
    monkeypatch.setenv("PDSERVE_API_KEY", "env-key")
    monkeypatch.setenv("PDSERVE_API_KEYS", "a, b")
    assert api_keys(build_parser().parse_args(["router"])) == ["env-key", "a", "b"]
    args = build_parser().parse_args(["up", "--api-key", "flag-key", "--api-key-file", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="cannot read --api-key-file"):
        api_keys(args)
