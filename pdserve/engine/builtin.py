"""The built-in models, created once into a cache directory on first use."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pdserve.engine import tiny_model, tiny_tokenizer
from pdserve.engine.tiny_model import make_tiny_model
from pdserve.engine.tiny_tokenizer import CORPUS

FORMAT_VERSION = 2
"""Bump when tiny_model.py or tiny_tokenizer.py changes what they write, so stale caches are not reused.
(The cache directory name also carries a digest of both modules and the corpus,
so two builds that differ never share a directory even if a bump is forgotten.)"""


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def source_digest() -> str:
    """What the built-in checkpoints are made from: both modules that write them and the corpus (a
    change to any is a new model, in a new cache directory)."""
    source = Path(tiny_model.__file__).read_bytes() + Path(tiny_tokenizer.__file__).read_bytes()
    return hashlib.sha256(source + CORPUS.read_bytes()).hexdigest()[:10]


def default_model_dir(size: str = "tiny", arch: str = "llama") -> Path:
    """Path of the built-in `size` model (of architecture `arch`: tiny_model.ARCHS), building it on
    first use.

    Safe under concurrent first use (several node processes start at once): each
    builder writes into its own temp dir and renames it into place; a loser of
    the race discards its copy.
    """
    name = size if arch == "llama" else f"{size}-{arch}"
    target = cache_root() / "models" / f"{name}-v{FORMAT_VERSION}-{source_digest()}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=target.parent))
    try:
        make_tiny_model(tmp, size, arch=arch)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
