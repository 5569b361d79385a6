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

It is also the one place that reads environment variables with a meaning of their own
(`process_env`), and where parsed flags become config dataclass fields (`flag_values`): flags
default to None, so a flag left unset keeps the dataclass field's default, the only default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, NamedTuple

import configargparse

ENV_PREFIX = "PDSERVE_"
CONFIG_FLAG = "--config"
# Variables a command reads itself with their own meaning (PDSERVE_API_KEY is one key, merged with
# --api-key by the router); the generic mapping must not also turn them into a flag value.
API_KEY_ENV = "PDSERVE_API_KEY"
"""One accepted router Bearer key (merged with --api-key, --api-key-file and PDSERVE_API_KEYS)."""
API_KEYS_ENV = "PDSERVE_API_KEYS"
"""Comma-separated accepted router Bearer keys."""
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""--cluster-secret through the generic mapping; named here because `pdserve up` sets it for its children."""
POD_IP_ENV = "POD_IP"
"""Kubernetes downward API: the pod's address, advertised when --advertise-host is unset."""
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
"""torch.distributed's rendezvous, which `pdserve batch --external-stages` checks before joining it."""
SELF_READ_ENV = frozenset({API_KEY_ENV})


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


class ProcessEnv(NamedTuple):
    """The environment variables pdserve reads itself (beyond PDSERVE_<FLAG>), read in this one place."""

    api_keys: list[str]
    """$PDSERVE_API_KEY then the entries of $PDSERVE_API_KEYS, unstripped, empties included."""
    pod_ip: str
    """$POD_IP, or empty."""
    rendezvous: dict[str, str]
    """Each of RENDEZVOUS_ENV that is set (torch.distributed reads them itself as well)."""


def process_env() -> ProcessEnv:
    return ProcessEnv(
        api_keys=[os.environ.get(API_KEY_ENV, "")] + os.environ.get(API_KEYS_ENV, "").split(","),
        pod_ip=os.environ.get(POD_IP_ENV, ""),
        rendezvous={v: os.environ[v] for v in RENDEZVOUS_ENV if v in os.environ},
    )


def flag_values(args: argparse.Namespace, cls: type, **dests: str | None) -> dict[str, Any]:
    """Keyword arguments for dataclass `cls`: each field whose flag was given (not None).

    A field's flag has the field's name as its dest unless `dests` maps the field to another
    dest (EngineConfig.model_dir <- --model) or to None (a composed part, built on its own);
    a flag the command lacks counts as unset."""
    values = {}
    for f in dataclasses.fields(cls):
        dest = dests.get(f.name, f.name)
        value = None if dest is None else getattr(args, dest, None)
        if value is not None:
            values[f.name] = value
    return values
