"""`--kv-cache-memory`, `--gpu-memory-utilization`, `--max-model-len`: how big the KV pool is and the
longest sequence it must hold, shared by every command that builds an engine (`generate`, `prefill`,
`decode`, `up`, which hands them to its nodes, and `batch`/`stage`, per pipeline stage).

The sizing itself is `engine.kv_sizing`; at start a `--max-model-len` that the pool cannot hold is
refused with the flags to change.
"""

from __future__ import annotations

import argparse

from pdserve.engine.kv_sizing import parse_memory_size


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


def add_kv_memory_args(
    p: argparse.ArgumentParser, *, max_model_len: bool = True, gpu: bool = True, offloading: bool = True
) -> None:
    """Add the flags (defaults None: EngineConfig's defaults apply); `batch` takes neither
    --max-model-len nor --gpu-memory-utilization (its stages are not profiled) nor a host KV tier."""
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-bytes",
        dest="kv_cache_bytes",
        type=memory_size,
        default=None,
        help="KV pool size, e.g. 4GiB or 512MiB or bytes (default on CPU: a tenth of the available "
        "memory, at most what --max-num-seqs (at most 64) sequences of --max-model-len tokens fill; on CUDA: "
        "from --gpu-memory-utilization)",
    )
    if gpu:
        p.add_argument(
            "--gpu-memory-utilization",
            type=utilization,
            default=None,
            help="CUDA: share of the card this process may use; KV gets what the weights and the peak "
            "activations of a forward at the largest batch leave (default 0.9)",
        )
    if max_model_len:
        add_max_model_len_arg(p)
    if offloading:
        p.add_argument(
            "--kv-offloading-size",
            dest="kv_offloading_bytes",
            type=offloading_size,
            default=None,
            help="host memory for a KV tier below the pool, in GiB (e.g. 8) or with a unit (512MiB): finished "
            "requests' blocks are kept there and restored instead of recomputed once the pool has evicted "
            "them (default: no tier)",
        )
        p.add_argument(
            "--kv-offloading-backend",
            default=None,
            choices=("native",),
            help="where that tier lives: native, this process's host memory, the only backend (accepted for "
            "vLLM's command lines; default native)",
        )


def add_max_model_len_arg(p: argparse.ArgumentParser) -> None:
    """--max-model-len: the engine's (with the KV flags above), and the router's ceiling on it."""
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output; refused at start when the KV pool cannot hold it "
        "(default: the model's max_position_embeddings, lowered to what the pool holds; on the router: "
        "a ceiling on what its nodes report)",
    )


def kv_memory_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments set on the command line (unset ones are left out)."""
    names = (
        "kv_cache_bytes",
        "gpu_memory_utilization",
        "max_model_len",
        "kv_offloading_bytes",
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
}
"""Each memory setting's flag on a child process."""
