"""vLLM's serving flags, declared once for the commands that take them, and handed on by `pdserve up`.

Which command takes which follows where the work happens: the router names the model, renders chat
templates and fills in sampling defaults (`--served-model-name`, `--chat-template`,
`--generation-config`, `--enable-prompt-tokens-details`); the nodes schedule and sample
(`--max-num-seqs`, `--max-num-batched-tokens`, `--seed`) and label their metrics with the served name;
`up` takes them all and passes each to the processes that use it (`child_flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.commands.config_flags import config_flag

if TYPE_CHECKING:  # the CLI imports no serving code until a command runs
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.router.config import RouterConfig

ROUTER_FLAGS = ("served_model_name", "tokenizer", "chat_template", "generation_config", "enable_prompt_tokens_details")
"""What `up` hands its router (besides --model and --max-model-len)."""
NODE_FLAGS = (
    "served_model_name",
    "tokenizer",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "enable_expert_parallel",
    "dist_timeout",
    "enforce_eager",
)
"""What `up` hands its nodes (besides the model, device and KV flags)."""


def add_served_name_args(p: argparse.ArgumentParser, config: type | None = None) -> None:
    """--served-model-name of the router (`config` None: RouterConfig; `up` hands it on) or of a node."""
    from pdserve.router.config import RouterConfig

    config_flag(p, config or RouterConfig, "served_model_name", nargs="+", metavar="NAME")


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """The router's: how a request becomes a prompt and sampling parameters, and what usage reports."""
    from pdserve.router.config import RouterConfig

    config_flag(p, RouterConfig, "chat_template")
    add_generation_config_arg(p)
    config_flag(p, RouterConfig, "enable_prompt_tokens_details", action=argparse.BooleanOptionalAction)
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        default=None,
        help="accepted for vLLM command lines: pdserve never logs requests (no access log, no prompts)",
    )


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    """--generation-config, shared by the router and `pdserve batch` (both build sampling parameters;
    the batch job, unset, takes the same default)."""
    from pdserve.router.config import RouterConfig

    config_flag(p, RouterConfig, "generation_config", metavar="auto|vllm|DIR")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The engine's batch limits, seed and tensor-parallel collective timeout (nodes; `up` passes
    them on)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.node_runtime.node_config import role_defaults

    config_flag(p, EngineConfig, "max_num_seqs")
    config_flag(p, EngineConfig, "max_num_batched_tokens", stated_default=role_defaults("max_num_batched_tokens"))
    config_flag(p, EngineConfig, "seed")
    config_flag(p, EngineConfig, "dist_timeout")


def load_frontend(config: RouterConfig) -> tuple[Tokenizer, dict]:
    """The tokenizer (with --chat-template) and the sampling defaults of --generation-config, logged
    as vLLM logs them; a bad template or generation config exits with the reason."""
    import logging

    from pdserve.engine.chat_template import load_chat_template
    from pdserve.engine.generation_defaults import generation_defaults
    from pdserve.engine.tokenizer import Tokenizer

    try:
        template = load_chat_template(config.chat_template) if config.chat_template else None
        tokenizer = Tokenizer(config.tokenizer or config.model_dir, template)
        defaults = generation_defaults(config.generation_config, config.model_dir)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if defaults:
        logging.getLogger("pdserve.router").info(
            "default sampling parameters from generation_config.json (requests that set a field override it; "
            "--generation-config vllm ignores the file): %s",
            defaults,
        )
    return tokenizer, defaults


def declared_dests(add: Callable[[argparse.ArgumentParser], None]) -> tuple[str, ...]:
    """The dests of the flags `add` declares, so a command that hands them on to a child names them
    where they are declared, not in a second list."""
    p = argparse.ArgumentParser(add_help=False)
    add(p)
    return tuple(a.dest for a in p._actions)


def child_flags(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    """The flags that give a child process the same values (unset ones are left out)."""
    flags: list[str] = []
    for dest in dests:
        value = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags
