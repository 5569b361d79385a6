"""Helpers shared by the benchmark scripts: machine description, result line, BENCHMARKS.md row."""

from __future__ import annotations

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
    return f"{os.cpu_count()} CPU cores ({cpu}), no GPU"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def emit(result: dict) -> None:
    """Print the result as the last stdout line (one JSON object), with command/date/machine."""
    result = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "machine": machine(), **result}
    print(json.dumps(result), flush=True)
