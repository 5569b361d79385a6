"""`--kv-cache-memory`, `--gpu-memory-utilization`, `--max-model-len`: how big the KV pool is and the
longest sequence it must hold, shared by every command that builds an engine (`generate`, `prefill`,
`decode`, `up`, which hands them to its nodes, and `batch`/`stage`, per pipeline stage).

The sizing itself is `engine.kv_sizing`; at start a `--max-model-len` that the pool cannot hold is
refused with the flags to change.
"""

from __future__ import annotations

import argparse

from pdserve.commands.config_flags import config_flag, with_default
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_sizing import parse_memory_size
from pdserve.tdpipe.runtime.batch_config import FIXED_DEFAULT_BLOCKS


def memory_size(text: str) -> int:
    """argparse type: bytes from `4GiB`, `512MiB`, `4G`, `4GB` or a plain byte count."""
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def utilization(text: str) -> float:
    """argparse type: a share of the GPU in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def offloading_size(text: str) -> int:
    """argparse type of --kv-offloading-size: GiB as a plain number (vLLM's unit, e.g. 8 or 0.5),
    or a size with its unit (512MiB); bytes."""
    try:
        if text.replace(".", "", 1).isdigit():
            value = int(float(text) * 2**30)
            if value <= 0:
                raise ValueError(f"must be positive, got {text!r}")
            return value
        return parse_memory_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


KV_CACHE_MEMORY_FLAGS = ("--kv-cache-memory", "--kv-cache-bytes")
OFFLOADING_BACKENDS = ("native",)
"""--kv-offloading-backend's choices, the first its default."""


def add_kv_memory_args(p: argparse.ArgumentParser) -> None:
    """The engine's pool flags, from EngineConfig's fields (defaults None: its defaults apply)."""
    config_flag(p, EngineConfig, "kv_cache_bytes", *KV_CACHE_MEMORY_FLAGS, type=memory_size)
    config_flag(p, EngineConfig, "gpu_memory_utilization", type=utilization)
    add_max_model_len_arg(p)
    config_flag(p, EngineConfig, "kv_offloading_bytes", "--kv-offloading-size", type=offloading_size)
    config_flag(p, EngineConfig, "kv_store", metavar="URL")
    p.add_argument(
        "--kv-offloading-backend",
        default=None,
        choices=OFFLOADING_BACKENDS,
        help=with_default(
            "where that tier lives: native, this process's host memory, the only backend (accepted for vLLM's "
            "command lines)",
            OFFLOADING_BACKENDS[0],
        ),
    )


def add_stage_kv_memory_arg(p: argparse.ArgumentParser) -> None:
    """--kv-cache-memory of `batch` and `stage`: the pool of each pipeline stage, sized by
    tdpipe.runtime.batch_kv (neither takes --max-model-len nor --gpu-memory-utilization: stages are
    not profiled; nor a host KV tier)."""
    p.add_argument(
        *KV_CACHE_MEMORY_FLAGS,
        dest="kv_cache_bytes",
        type=memory_size,
        default=None,
        help="KV pool size of each stage, e.g. 4GiB or 512MiB or bytes (default: on CPU a share of the "
        "host's available memory split among the local stages; on CUDA and with --external-stages, "
        f"{FIXED_DEFAULT_BLOCKS} KV blocks)",
    )


def add_max_model_len_arg(p: argparse.ArgumentParser, config: type = EngineConfig) -> None:
    """--max-model-len: the engine's (with the KV flags above), and the router's ceiling on it
    (`config` RouterConfig)."""
    config_flag(p, config, "max_model_len")


def kv_memory_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments set on the command line (unset ones are left out)."""
    names = (
        "kv_cache_bytes",
        "gpu_memory_utilization",
        "max_model_len",
        "kv_offloading_bytes",
        "kv_store",
    )
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def kv_memory_flags(args: argparse.Namespace) -> list[str]:
    """The same settings as flags for a child process (`pdserve up`); empty when unset."""
    opts = kv_memory_options(args)
    if "kv_offloading_bytes" in opts:  # bytes, said with their unit (a bare number would read as GiB)
        opts["kv_offloading_bytes"] = f"{opts['kv_offloading_bytes']}B"
    return [x for name, value in opts.items() for x in (CHILD_FLAGS[name], str(value))]


CHILD_FLAGS = {
    "kv_cache_bytes": "--kv-cache-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "kv_offloading_bytes": "--kv-offloading-size",
    "kv_store": "--kv-store",
}
"""Each memory setting's flag on a child process."""
