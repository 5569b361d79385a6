"""Helpers shared by the benchmark scripts: machine description, result line, and the alternation of
a comparison's arms over rounds with the median of each figure."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Collection
from typing import NamedTuple


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
        "command": " ".join(["python", run, shlex.join(sys.argv[1:])]).rstrip(),  # quoted: it reruns as printed
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        **result,
    }
    print(json.dumps(result), flush=True)


def node_bench_args(description: str, secret: str, rounds: bool = False) -> tuple[argparse.Namespace, str, list[str]]:
    """The flags of the benchmarks that start node processes (--quick, --model-size; --rounds with `rounds`), the model
    directory and the node flags they share (free port, that model, the secret, one torch thread)."""
    from pdserve.engine.builtin import default_model_dir

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    if rounds:  # a comparison of arms (`alternate`)
        add_rounds_arg(parser)
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    return args, model, ["--port", "0", "--model", model, "--cluster-secret", secret, "--num-threads", "1"]


def add_rounds_arg(parser: argparse.ArgumentParser, default: int = 3) -> None:
    """`--rounds N`: how many times every arm runs, alternating which goes first (`alternate`)."""

    def rounds(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
        return int(text)

    parser.add_argument(
        "--rounds",
        type=rounds,
        default=default,
        help=f"rounds of every arm, alternating which runs first; the median is reported (default {default})",
    )


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """The arms in their given order on even rounds, reversed on odd ones: neither arm always runs
    first (on a warm or a cold machine, before or after the other's load), so drift over the run
    falls on both."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


class Rounds(NamedTuple):
    """What `alternate` ran: per round, each arm's figures; and why an optional arm stopped."""

    rounds: list[dict[str, dict]]
    errors: dict[str, str]

    def of(self, arm: str) -> list[dict]:
        """The arm's figures of every round it ran in."""
        return [r[arm] for r in self.rounds if arm in r]

    def ratios(self, arm: str, peer: str, key: str) -> list[float]:
        """arm / peer of `key`, per round where both ran (a paired ratio: same round, same load)."""
        return [r[arm][key] / r[peer][key] for r in self.rounds if arm in r and peer in r and r[peer][key]]

    def median_ratio(self, arm: str, peer: str, key: str) -> float | None:
        """The median of `ratios`, to 3 places: the figure a comparison reports (None: no round had both)."""
        paired = self.ratios(arm, peer, key)
        return round(statistics.median(paired), 3) if paired else None


def alternate(
    arms: dict[str, Callable[[], dict]],
    rounds: int,
    optional: Collection[str] = (),
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> Rounds:
    """Run every arm once per round, in `arm_order`. An arm in `optional` (a peer that may fail to
    start) that raises RuntimeError/OSError is recorded in `errors` and left out of later rounds;
    any other arm's failure propagates."""
    per_round: list[dict[str, dict]] = []
    errors: dict[str, str] = {}
    for r in range(rounds):
        got: dict[str, dict] = {}
        for name in arm_order(list(arms), r):
            if name in errors:
                continue
            try:
                got[name] = arms[name]()
            except (RuntimeError, OSError) as e:
                if name not in optional:
                    raise
                errors[name] = last_error_line(e)
                log(f"round {r}: {name} failed: {errors[name]}")
        log(f"round {r} of {rounds} done ({', '.join(arm_order(list(arms), r))})")
        per_round.append(got)
    return Rounds(per_round, errors)


def last_error_line(e: BaseException) -> str:
    """The line of an exception's text that names the error (a server's log tail ends in noise)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return ((named or lines or [type(e).__name__])[-1]).strip()[:300]


def median_figures(per_round: list[dict]) -> dict:
    """Each figure's median over the rounds: numbers by `statistics.median`, flags true only if true
    in every round, anything else (names, lists) as the first round has it."""
    if not per_round:
        return {}
    out: dict = {}
    for key, first in per_round[0].items():
        values = [r[key] for r in per_round if key in r]
        if isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, int | float) and all(isinstance(v, int | float) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out
