"""Shared fixtures: the built-in tiny model, built once per cache directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Keep test builds of the built-in model inside the checkout unless told otherwise.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(ROOT / ".cache" / "pdserve"))
# The tests spawn node processes (fork, then exec after a preexec_fn) while this process has gRPC
# channels polling. gRPC's fork handlers then run in the child between fork and exec, where they
# can fail on the parent's epoll descriptor and kill the child before it starts (seen once in
# four full runs: "epoll_wait error: Bad file descriptor"). No test uses gRPC in a forked child,
# so the handlers are turned off; this must happen before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Triton kernels (engine.attention.triton_decode) run under Triton's interpreter where there is no
# GPU to compile for. Triton reads this when triton.language is first imported, so it is set here,
# before any test imports it; a GPU session (pytest -m gpu on a CUDA machine) runs them compiled.
if not any(Path("/dev").glob("nvidia[0-9]*")) and not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from pdserve.engine.builtin import default_model_dir

    return default_model_dir("tiny")
