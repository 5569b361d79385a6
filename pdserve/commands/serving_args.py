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
)
"""What `up` hands its nodes (besides the model, device and KV flags)."""


def add_served_name_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model names clients may use (several: each is accepted and listed in /v1/models; the first "
        "labels the metrics; default: the Hub id given to --model, else the model directory's name)",
    )


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """The router's: how a request becomes a prompt and sampling parameters, and what usage reports."""
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, used instead of the checkpoint's",
    )
    add_generation_config_arg(p)
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens (default on, as OpenAI does; "
        "--no-enable-prompt-tokens-details leaves it out, vLLM's default)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        default=None,
        help="accepted for vLLM command lines: pdserve never logs requests (no access log, no prompts)",
    )


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    """--generation-config, shared by the router and `pdserve batch` (both build sampling parameters)."""
    p.add_argument(
        "--generation-config",
        default=None,
        metavar="auto|vllm|DIR",
        help="sampling defaults for requests that leave a field unset: auto reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
        "vllm ignores it, DIR reads DIR/generation_config.json (default auto, as vLLM)",
    )


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The engine's batch limits and seed (nodes; `up` passes them on)."""
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step (default 256)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step; longer prompts are prefilled in chunks "
        "(default: 8192 on prefill nodes, 2048 on decode nodes)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed of the engine (default 0)")


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
