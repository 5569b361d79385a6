"""Every flag of every command is settable by PDSERVE_<FLAG> and by --config FILE (YAML)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import COMMANDS, build_parser
from pdserve.node_runtime.config import env_name


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _value_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Flags that take one value (store actions with a long option), the generic case."""
    return [
        a
        for a in p._actions
        if type(a).__name__ == "_StoreAction"
        and a.option_strings
        and a.option_strings[-1].startswith("--")
        and a.nargs is None
        and flag_is_not_config(a)
    ]


def flag_is_not_config(action: argparse.Action) -> bool:
    return "--config" not in action.option_strings


def _sample(action: argparse.Action) -> tuple[str, object]:
    """A value the flag accepts, as a string and as parsed."""
    if action.choices:
        choice = list(action.choices)[-1]
        return str(choice), choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "0.5", 0.5
    return "some-value", "some-value"


def test_every_value_flag_of_every_command_reads_env_and_config(tmp_path, monkeypatch):
    subparsers = _subparsers(build_parser())
    checked = 0
    for command in (c.replace("_", "-") for c in COMMANDS):
        sub = subparsers[command]
        # Positional arguments are not flags; give each a placeholder so the command parses.
        positional = ["placeholder" for a in sub._actions if not a.option_strings and a.required]
        required = [a for a in sub._actions if a.option_strings and a.required]  # e.g. batch -i/-o, stage --model-dir
        for action in _value_flags(sub):
            # configargparse names the variable after the first long option (--input-file, not its --input alias)
            flag = next(o for o in action.option_strings if o.startswith("--"))
            if action.type not in (None, str, int, float):
                continue  # a custom parser type: its own tests cover values
            # every other required flag on the command line, so that only `flag` comes from env/config
            argv = (
                [command]
                + positional
                + [x for r in required if r is not action for x in (r.option_strings[-1], _sample(r)[0])]
            )
            text, parsed = _sample(action)
            monkeypatch.setenv(env_name(flag), text)
            assert getattr(build_parser().parse_args(argv), action.dest) == parsed, (command, flag, "env")
            monkeypatch.delenv(env_name(flag))
            cfg = tmp_path / "c.yaml"
            cfg.write_text(f"{flag.lstrip('-')}: '{text}'\n")
            assert getattr(build_parser().parse_args(argv + ["--config", str(cfg)]), action.dest) == parsed, (
                command,
                flag,
                "config",
            )
            checked += 1
    assert checked > 20


def test_precedence_cli_over_env_over_file(tmp_path, monkeypatch):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("port: 9100\nhost: 10.0.0.1\nmax-prompt-tokens: 77\n")
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    args = build_parser().parse_args(["router", "--config", str(cfg), "--port", "1"])
    assert (args.port, args.host, args.max_prompt_tokens) == (1, "0.0.0.0", 77)


def test_repeatable_flag_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY_FILE", "[k1, k2]")
    assert build_parser().parse_args(["router"]).api_key_file == ["k1", "k2"]
    monkeypatch.delenv("PDSERVE_API_KEY_FILE")
    # PDSERVE_API_KEY keeps its own meaning (one key, read by the router), not --api-key's value
    monkeypatch.setenv("PDSERVE_API_KEY", "secret")
    assert build_parser().parse_args(["router"]).api_key is None
    cfg = tmp_path / "r.yaml"
    cfg.write_text("api-key:\n  - a\n  - b\n")
    assert build_parser().parse_args(["router", "--config", str(cfg)]).api_key == ["a", "b"]


def test_unknown_config_key_and_bad_env_value_are_errors(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("prot: 9000\n")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["router", "--config", str(cfg)])
    assert exit_.value.code == 2 and "prot" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_PORT", "not-a-number")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["router"])
    assert exit_.value.code == 2 and "port" in capsys.readouterr().err
