"""Shared fixtures: the built-in tiny model, built once per cache directory."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from pdserve.engine.builtin import default_model_dir

    return default_model_dir("tiny")
