"""Helpers shared by the benchmark scripts: machine description, result line, BENCHMARKS.md row."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPU cores ({cpu}), {_gpu()}"


def _gpu() -> str:
    """The first CUDA device's name, or "no GPU" (torch is imported only if already loaded, so a
    benchmark that never touches torch does not pay for it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return "no GPU"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def emit(result: dict) -> None:
    """Print the result as the last stdout line (one JSON object), with command/date/machine."""
    script = sys.argv[0]  # under `python -m benchmarks.X` this is the file's full path: name the module instead
    run = f"-m benchmarks.{os.path.basename(script)[:-3]}" if script.endswith(".py") else script
    result = {
        "command": " ".join(["python", run] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        **result,
    }
    print(json.dumps(result), flush=True)


def node_bench_args(description: str, secret: str) -> tuple[argparse.Namespace, str, list[str]]:
    """The flags of the benchmarks that start node processes (--quick, --model-size), the model
    directory and the node flags they share (free port, that model, the secret, one torch thread)."""
    from pdserve.engine.builtin import default_model_dir

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    return args, model, ["--port", "0", "--model", model, "--cluster-secret", secret, "--num-threads", "1"]
