"""Shared fixtures: the built-in tiny model, built once per cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Keep test builds of the built-in model inside the checkout unless told otherwise.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(ROOT / ".cache" / "pdserve"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from engine.builtin import default_model_dir

    return default_model_dir("tiny")
