"""pdserve engine: paged-KV inference for Hugging Face Llama-family checkpoints.

Public names are imported lazily so that light users (the router needs only
`engine.tokenizer`) do not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "EngineLoad": "pdserve.engine.llm_engine",
    "EngineConfig": "pdserve.engine.config",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestOutput": "pdserve.engine.request",
    "CompletionOutput": "pdserve.engine.request",
    "StepOutput": "pdserve.engine.request",
    "RequestStatus": "pdserve.engine.request",
    "TokenLogprob": "pdserve.engine.request",
    "AdmissionError": "pdserve.engine.request",
    "blocks_for": "pdserve.engine.block_manager",
    "Tokenizer": "pdserve.engine.tokenizer",
    "IncrementalDetokenizer": "pdserve.engine.tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
