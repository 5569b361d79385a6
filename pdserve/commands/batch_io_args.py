"""`pdserve batch` flags of the input/output side: order, window, line bound, model name, metrics."""

from __future__ import annotations

import argparse

from pdserve.commands.config_flags import plain_flag
from pdserve.tdpipe.runtime.batch_input import DEFAULT_MAX_LINE_BYTES

DEFAULT_LINES_IN_FLIGHT = 4096


def add_batch_io_args(p: argparse.ArgumentParser) -> None:
    plain_flag(
        p,
        "--output-order",
        choices=["input", "completion"],
        default="input",
        help="input: output lines in input-line order, as vLLM's run-batch writes them (a finished line waits "
        "for the earlier ones, within --max-lines-in-flight); completion: each line as soon as it finishes",
    )
    plain_flag(
        p,
        "--max-lines-in-flight",
        type=int,
        default=DEFAULT_LINES_IN_FLIGHT,
        help="input lines read but not yet written (the window the input is streamed through; it bounds "
        "memory and the input-order buffer)",
    )
    plain_flag(
        p,
        "--max-line-bytes",
        type=int,
        default=DEFAULT_MAX_LINE_BYTES,
        help="a longer input line becomes an error line (line_too_long) without being held in memory",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name responses carry and lines may name (default: the model directory's name, "
        "pdserve-tiny for the built-in model); a line naming another model gets a model_not_found error",
    )
    p.add_argument(
        "--local-output-dir",
        default=None,
        help="where an http(s) --output-file is written before upload (default: the temp directory); the "
        "file's name derives from the URL so --resume finds it",
    )
    p.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve Prometheus metrics during the job (requests done/failed, tokens, phase, bubble fraction)",
    )
    plain_flag(p, "--url", dest="metrics_host", default="0.0.0.0", help="address of the metrics server")
    plain_flag(p, "--port", type=int, default=8000, help="port of the metrics server")
