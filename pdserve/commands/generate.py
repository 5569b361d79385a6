"""`pdserve generate`: offline generation with the engine (no cluster)."""

from __future__ import annotations

import argparse
import sys

from pdserve.commands.config_flags import config_flag, plain_flag
from pdserve.commands.model_args import add_model_args


DEFAULT_MAX_TOKENS = 32
DEFAULT_TEMPERATURE = 0.0
"""Greedy: the same text every run (SamplingParams' own default, 1.0, is for requests)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.engine.sampling_params import SamplingParams

    p = subparsers.add_parser("generate", help="generate text offline from prompts")
    add_model_args(p)
    from pdserve.commands.device_args import add_device_args, add_enforce_eager_arg, add_tensor_parallel_arg

    add_device_args(p)
    add_tensor_parallel_arg(p)
    add_enforce_eager_arg(p)
    from pdserve.commands.memory_args import add_kv_memory_args

    add_kv_memory_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: a sample prompt)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    plain_flag(p, "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens to generate per prompt")
    plain_flag(p, "--temperature", type=float, default=DEFAULT_TEMPERATURE, help="sampling temperature (0: greedy)")
    config_flag(p, SamplingParams, "top_p", keep_default=True)
    config_flag(p, SamplingParams, "seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.parallel.group import RankFailure
    from pdserve.commands.device_args import device_options
    from pdserve.commands.memory_args import kv_memory_options

    prompts = args.prompt or ["The old lighthouse keeper"]
    llm = None
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        # unset: EngineConfig's defaults
        chosen = (
            ("dtype", args.dtype),
            ("tokenizer", args.tokenizer),
            ("tensor_parallel_size", args.tensor_parallel_size),
            ("enable_expert_parallel", args.enable_expert_parallel),
            ("enforce_eager", args.enforce_eager),
        )
        options = {k: v for k, v in chosen if v}
        llm = LLM(args.model, **options, **device_options(args), **kv_memory_options(args))
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:  # a rank died: every other rank is already stopped
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if llm is not None:
            llm.close()
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        print(
            f"### prompt: {prompt!r}\n{comp.text}\n[{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]"
        )
    return 0
