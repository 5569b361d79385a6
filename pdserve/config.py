"""One place where every `pdserve` command gets env and config-file settings.

Every parser the CLI builds comes from `new_parser` (the root) and the root's
subparser action, which reuses the same class and keyword arguments. So a flag
any command adds, today or later, is settable three ways without extra code:

    pdserve router --port 9000                 # command line (wins)
    PDSERVE_PORT=9000 pdserve router           # environment: PDSERVE_<FLAG>, dashes -> underscores
    pdserve router --config router.yaml        # YAML file: `port: 9000` (flag name without dashes)

Precedence is command line > environment > config file > default, as
configargparse implements it. Lists (repeatable flags) take `[a, b]` in env
and a YAML list in the file.
"""

from __future__ import annotations

import argparse
from typing import Any

import configargparse

ENV_PREFIX = "PDSERVE_"
CONFIG_FLAG = "--config"
# Variables a command reads itself with their own meaning (PDSERVE_API_KEY is one key, merged with
# --api-key by the router); the generic mapping must not also turn them into a flag value.
SELF_READ_ENV = frozenset({"PDSERVE_API_KEY"})


class _CommandParser(configargparse.ArgumentParser):
    """A configargparse parser that every subcommand inherits through `add_subparsers`.

    argparse builds subparsers with `type(self)(**kwargs)`; the defaults below
    make each one read `PDSERVE_<FLAG>` and accept `--config FILE`, so command
    modules keep writing plain `p.add_argument(...)`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_env_var_prefix", ENV_PREFIX)
        kwargs.setdefault("config_file_parser_class", configargparse.YAMLConfigFileParser)
        kwargs.setdefault("args_for_setting_config_path", [CONFIG_FLAG])
        kwargs.setdefault("config_arg_help_message", "YAML file of flag: value settings (flag names without --)")
        # An unknown key in the file is an error naming it, not a silently ignored typo.
        kwargs.setdefault("ignore_unknown_config_file_keys", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any):
        action = super().add_argument(*args, **kwargs)
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and env_name(long[0]) in SELF_READ_ENV:
            # configargparse maps only actions without an env_var; this name (never a real variable)
            # keeps it from mapping, and `--help` shows who reads the variable instead.
            action.env_var = f"{env_name(long[0])} (read by the command)"
        return action


def new_parser(**kwargs: Any) -> argparse.ArgumentParser:
    """The root `pdserve` parser; its subparsers are `_CommandParser`s too."""
    # The root has no flags of its own beyond --help, so env/config apply per command.
    kwargs.setdefault("auto_env_var_prefix", None)
    kwargs.setdefault("args_for_setting_config_path", [])
    return _CommandParser(**kwargs)


def env_name(flag: str) -> str:
    """The environment variable that sets `flag` (e.g. `--max-prompt-tokens`)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
