"""`--generation-config auto|vllm|DIR`: the sampling defaults a checkpoint's generation_config.json
asks for, applied to every request that leaves the field unset (as vLLM does).

Only the keys vLLM takes are read (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and
`max_new_tokens`, the default `max_tokens`), and only when the file sets them: transformers' class
defaults (top_k 50) are not applied, and `do_sample` is ignored, as in vLLM. `vllm` ignores the file
(the API's own defaults: temperature 1, no top-k/top-p); a directory reads that directory's file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.engine.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")
"""The named settings; anything else is a directory holding a generation_config.json."""
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> the request field it is the default of."""


DEFAULT_GENERATION_CONFIG = "auto"
"""--generation-config unset: the checkpoint's generation_config.json, as vLLM reads it."""


def generation_defaults(setting: str, model_dir: str | Path) -> dict[str, Any]:
    """The request-field defaults of `setting` for the checkpoint at `model_dir` (empty: none).
    ValueError for a directory without the file, unreadable JSON or a value no request may have."""
    if setting == "vllm":
        return {}
    directory = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    file = directory / "generation_config.json"
    if not file.is_file():
        if setting == "auto":
            return {}  # a checkpoint without the file has no defaults
        raise ValueError(f"--generation-config {setting}: no generation_config.json in that directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    defaults: dict[str, Any] = {}
    for key, field in KEYS.items():
        value = config.get(key)
        integral = key in ("top_k", "max_new_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int if integral else (int, float))):
            raise ValueError(f"{file}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
        if value is not None:
            defaults[field] = value
    try:
        SamplingParams(**defaults)  # the same checks as a request's values
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None
    return defaults
