"""Loading Hugging Face safetensors checkpoints, one slice of layers at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import TPShard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(option: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (no fast fp16 path there) and the checkpoint's dtype elsewhere."""
    if option == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype, torch.bfloat16)
    if option not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {option!r}")
    return DTYPES[option]


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the file holding it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def needed_tensor_names(config: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """Names of the checkpoint tensors a process holding `layer_range` must read."""
    start, end = layer_range
    first, last = start == 0, end == config.num_hidden_layers
    names: list[str] = []
    if first or (last and config.tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    for i in range(start, end):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if last:
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
    return names


def load_tensors(
    model_dir: str | Path,
    config: ModelConfig,
    layer_range: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    shard: TPShard | None = None,
) -> dict[str, torch.Tensor]:
    """Read exactly the tensors of `layer_range` (plus embeddings / norm / lm_head at the ends).

    With `shard`, a tensor-parallel rank reads only its slice of each split tensor from the file
    (safetensors slices: the rest of the tensor is never materialized on this rank)."""
    files = _tensor_files(Path(model_dir))
    wanted = needed_tensor_names(config, layer_range)
    missing = [n for n in wanted if n not in files]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:5])}")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                cut = shard.tensor_slice(name, config) if shard is not None else None
                if cut is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, start, stop = cut
                    index = (slice(None),) * dim + (slice(start, stop),)
                    tensor = f.get_slice(name)[index]
                out[name] = tensor.to(device=device, dtype=dtype)
    return out
