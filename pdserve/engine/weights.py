"""Loading Hugging Face safetensors checkpoints, one slice of layers at a time."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine import gpt_oss, mxfp4
from pdserve.engine.fp8 import check_fp8_scale, dequantize_fp8_block, fp8_gemm_unavailable, slice_fp8
from pdserve.engine.model_config import GPT_OSS, ModelConfig
from pdserve.engine.parallel.sharding import TPShard

log = logging.getLogger(__name__)

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


def expert_prefix(config: ModelConfig, layer: int) -> str:
    """The checkpoint prefix of layer `layer`'s sparse MLP: its router is `<prefix>gate.weight` and
    expert e's projections `<prefix>experts.<e>.<name>.weight` with EXPERT_NAMES' names."""
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}."


def expert_names(config: ModelConfig) -> tuple[str, str, str]:
    """(gate, up, down) projection names of one expert: Mixtral's w1, w3, w2; Qwen3-MoE's own."""
    if config.architecture == "MixtralForCausalLM":
        return ("w1", "w3", "w2")
    return ("gate_proj", "up_proj", "down_proj")


def layer_tensor_names(config: ModelConfig, layer: int, experts: range | None = None) -> list[str]:
    """The checkpoint tensors of decoder layer `layer` (global index); `experts`: the experts this
    process holds (expert parallelism), default all."""
    if config.architecture == GPT_OSS:  # fused expert tensors, sinks, router bias: its own names
        return gpt_oss.layer_tensor_names(config, layer)
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if config.mla is not None:
        names += mla_tensor_names(config, p + "self_attn.")
    else:
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
    if config.attention_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
    if config.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if config.is_sparse(layer):
        assert config.moe is not None
        moe = expert_prefix(config, layer)
        names.append(moe + "gate.weight")
        for e in experts if experts is not None else range(config.moe.num_experts):
            names += [f"{moe}experts.{e}.{x}.weight" for x in expert_names(config)]
        if config.moe.shared_intermediate_size:
            names += [f"{moe}shared_experts.{x}.weight" for x in expert_names(config)]
        if config.moe.topk_method == "noaux_tc":
            names.append(moe + "gate.e_score_correction_bias")
    else:
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def mla_tensor_names(config: ModelConfig, prefix: str) -> list[str]:
    """DeepSeek's latent attention tensors under `prefix` ("model.layers.N.self_attn.")."""
    assert config.mla is not None
    q = ["q_proj.weight"]
    if config.mla.q_lora_rank is not None:
        q = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    rest = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    return [prefix + n for n in q + rest]


def needed_tensor_names(config: ModelConfig, layer_range: tuple[int, int], experts: range | None = None) -> list[str]:
    """Names of the checkpoint tensors a process holding `layer_range` must read."""
    start, end = layer_range
    first, last = start == 0, end == config.num_hidden_layers
    names: list[str] = []
    if first or (last and config.tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    for i in range(start, end):
        names += layer_tensor_names(config, i, experts)
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
    fp8_gemm: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Read exactly the tensors of `layer_range` (plus embeddings / norm / lm_head at the ends).

    With `shard`, a tensor-parallel rank reads only its slice of each split tensor from the file
    (safetensors slices: the rest of the tensor is never materialized on this rank), and only its
    experts under expert parallelism.

    An FP8 block-quantized weight (one with a `weight_scale_inv` beside it) is dequantized to `dtype`
    at load, whole, then sliced; except where FP8 GEMMs run (`fp8_gemm`, default
    `fp8.fp8_gemm_supported(device, dtype)`, logged on CUDA): there the attention and dense MLP
    projections stay float8_e4m3fn, this rank's slice of them (128-aligned, else refused) with the
    matching block rows or columns of their scales, returned float32 under the checkpoint's
    `<name>_scale_inv` key beside each weight (`fp8.fused_linear` builds the linears). Experts are
    dequantized either way. MXFP4 experts (gpt-oss) are dequantized to `dtype` too, on any device
    (`engine.mxfp4`), only the blocks holding this rank's slice, and returned under their weight's
    name. A bias that `shard.zeroes` is returned as zeros."""
    files = _tensor_files(Path(model_dir))
    experts = shard.experts(config) if shard is not None else None
    wanted = needed_tensor_names(config, layer_range, experts)
    if config.mxfp4:  # gpt-oss's MXFP4 experts: read as blocks and scales, dequantized below
        wanted = mxfp4.stored_names(wanted, files)
    missing = [n for n in wanted if n not in files]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:5])}")
    _refuse_unserved(config, files, layer_range)
    _log_skipped_layers(config, files, layer_range)
    if fp8_gemm is None and config.fp8_block is not None:
        why_not = fp8_gemm_unavailable(device, dtype)
        fp8_gemm = why_not is None
        if device.type == "cuda":  # where either path could run: say which one did
            log.info("FP8 checkpoint: %s", "FP8 GEMMs" if fp8_gemm else f"dequantized at load ({why_not})")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}

    def cut_of(name: str) -> tuple[int, int, int] | None:
        return shard.tensor_slice(name, config) if shard is not None else None

    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                if config.mxfp4 and name.endswith(mxfp4.PARTS):  # uint8 codes and exponents: the blocks
                    mx_cut = cut_of(mxfp4.weight_name(name))  # that hold this rank's slice, as stored
                    out[name] = f.get_tensor(name) if mx_cut is None else f.get_slice(name)[mxfp4.stored_index(mx_cut)]
                    continue
                scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
                cut = cut_of(name)
                if scale_name in files:
                    weight, scale = _read_fp8(f.get_tensor(name), files, scale_name, config, name)
                    if fp8_gemm and ".experts." not in name:
                        if cut is not None:
                            weight, scale = slice_fp8(weight, scale, *cut, name)
                        out[name] = weight.contiguous().to(device)
                        out[scale_name] = scale.contiguous().to(device=device, dtype=torch.float32)
                        continue
                    assert config.fp8_block is not None  # _read_fp8 refuses a scale without it
                    tensor = dequantize_fp8_block(weight, scale, config.fp8_block, name)
                    if cut is not None:
                        dim, start, stop = cut
                        tensor = tensor.narrow(dim, start, stop - start)
                elif cut is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, start, stop = cut
                    index = (slice(None),) * dim + (slice(start, stop),)
                    tensor = f.get_slice(name)[index]
                if tensor.dtype == torch.float8_e4m3fn and scale_name not in files:
                    raise ValueError(f"{name} is float8 but the checkpoint has no {scale_name} to scale it")
                out[name] = tensor.to(device=device, dtype=dtype)
                if shard is not None and shard.zeroes(name):  # rank 0's copy alone enters the all-reduce
                    out[name].zero_()
    if config.mxfp4:
        if device.type == "cuda":
            log.info("MXFP4 checkpoint: experts dequantized to %s at load (no MXFP4 GEMMs)", dtype)
        mxfp4.dequantize_loaded(out, dtype, device, cut_of)
    return out


def _read_fp8(
    weight: torch.Tensor, files: dict[str, Path], scale_name: str, config: ModelConfig, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight and its block scales, both as the checkpoint stores them, checked."""
    if config.fp8_block is None:
        raise ValueError(f"{scale_name} found, but config.json has no quantization_config (quant_method 'fp8')")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} has a weight_scale_inv but is {weight.dtype}, not float8_e4m3fn")
    with safe_open(str(files[scale_name]), framework="pt", device="cpu") as s:
        scale = s.get_tensor(scale_name)
    check_fp8_scale(tuple(weight.shape), tuple(scale.shape), config.fp8_block, name)
    return weight, scale


def _log_skipped_layers(config: ModelConfig, files: dict[str, Path], layer_range: tuple[int, int]) -> None:
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer
    (`num_nextn_predict_layers`, for speculative decoding): not decoder layers, never loaded; said once."""
    n = config.num_hidden_layers
    layers = {int(name.split(".")[2]) for name in files if name.startswith("model.layers.")}
    extra = {i for i in layers if i >= n}
    if extra and layer_range[1] == n:
        log.info("skipping layers %s of the checkpoint: multi-token-prediction layers, not served", sorted(extra))


def _refuse_unserved(config: ModelConfig, files: dict[str, Path], layer_range: tuple[int, int]) -> None:
    """Tensors of a layer that the model code would silently ignore (a shared expert or its gate on
    an architecture without one, projection biases pdserve does not apply) are refused by name."""
    start, end = layer_range
    for name in files:
        if not name.startswith("model.layers."):
            continue
        layer = int(name.split(".")[2])
        if not start <= layer < end:
            continue
        if ".shared_expert" in name and not (config.moe is not None and config.moe.shared_intermediate_size):
            raise ValueError(f"{name}: {config.architecture} has no shared expert in pdserve")
        projection = ".mlp." in name or ".o_proj." in name or ".experts." in name
        if projection and name.endswith(".bias") and config.architecture != GPT_OSS:  # gpt-oss loads these
            raise ValueError(f"{name}: projection biases outside q/k/v are not supported")
