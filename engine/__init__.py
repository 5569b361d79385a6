"""pdserve engine: paged-KV inference for Hugging Face Llama-family checkpoints.

Public names are imported lazily so that light users (the router needs only
`engine.tokenizer`) do not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineLoad": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.request",
    "CompletionOutput": "engine.request",
    "StepOutput": "engine.request",
    "RequestStatus": "engine.request",
    "TokenLogprob": "engine.request",
    "AdmissionError": "engine.request",
    "blocks_for": "engine.block_manager",
    "Tokenizer": "engine.tokenizer",
    "IncrementalDetokenizer": "engine.tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
