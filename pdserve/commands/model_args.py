"""--model and the flags that say where its files are: shared by every command that loads a model or
its tokenizer (`generate`, `prefill`, `decode`, `router`, `up`).

`--model` (and `--tokenizer`) take a directory or a Hugging Face Hub id that is already in the local
HF cache (engine.hf_cache); `resolve_model_args` turns an id into its snapshot directory once, right
after parsing, so every later step (and every child of `up`) sees a plain directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.commands.config_flags import config_flag, with_default
from pdserve.engine.config import DTYPE_ALIASES, DTYPES, EngineConfig
from pdserve.engine.hf_cache import DEFAULT_REVISION


def dtype_name(text: str) -> str:
    """argparse type: a dtype or one of vLLM's aliases (half, float), as its canonical name."""
    return DTYPE_ALIASES.get(text, text)


def add_model_args(p: argparse.ArgumentParser, config: type = EngineConfig) -> None:
    """--model, --tokenizer, --revision, --download-dir, --dtype; `config` is the one the command
    builds (the router's RouterConfig takes the tokenizer)."""
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory, or a Hub id (org/name) already in the local HF cache "
        "(default: the built-in tiny model)",
    )
    config_flag(p, config, "tokenizer")
    p.add_argument(
        "--revision",
        default=None,
        help=with_default("branch, tag or commit of a Hub id --model in the cache", DEFAULT_REVISION),
    )
    p.add_argument(
        "--download-dir",
        default=None,
        help="the Hugging Face cache to find Hub ids in (default: $HF_HUB_CACHE, else $HF_HOME/hub, "
        "else ~/.cache/huggingface/hub); nothing is downloaded",
    )
    config_flag(p, EngineConfig, "dtype", type=dtype_name, choices=list(DTYPES))


def resolve_model_args(args: argparse.Namespace) -> None:
    """Replace a Hub id in --model/--tokenizer with its cached snapshot directory; with a Hub id
    --model, served names default to the id as vLLM's do. Exits with the download command when the
    id is not cached."""
    from pdserve.engine.hf_cache import resolve_model_path

    for dest in ("model", "tokenizer"):
        value = getattr(args, dest, None)
        if not value or Path(value).expanduser().is_dir():
            continue
        revision = args.revision if dest == "model" else None
        try:
            setattr(args, dest, str(resolve_model_path(value, args.download_dir, revision)))
        except ValueError as e:
            raise SystemExit(f"error: --{dest}: {e}") from None
        if dest == "model" and hasattr(args, "served_model_name") and not args.served_model_name:
            args.served_model_name = [value]
