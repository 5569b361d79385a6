"""MXFP4 expert weights (gpt-oss checkpoints, `quantization_config.quant_method: mxfp4`), dequantized
at load to the compute dtype, on CPU and on CUDA alike (no MXFP4 GEMM is run: the experts then
serve as bf16/fp32 weights).

A weight W [E, R, C] is stored as `<name>_blocks` uint8 [E, R, C/32, 16], 32 FP4 (E2M1) codes per
block, two per byte, the low nibble the even element, and `<name>_scales` uint8 [E, R, C/32], one
E8M0 exponent per block (2^(s - 127)). gpt-oss stores its experts' `gate_up_proj` and `down_proj`
this way, as [E, out, in]: the dequantized tensor is returned transposed, [E, in, out], the layout
of its bf16 checkpoints and of transformers' parameters.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code: sign bit, two exponent bits, one mantissa bit (OCP MX spec)."""
PARTS = ("_blocks", "_scales")
BLOCK = 32
"""Values sharing one scale."""


def stored_names(names: list[str], files: Collection[str]) -> list[str]:
    """`names` as the checkpoint holds them: a weight absent from `files` whose `_blocks` is there
    becomes its blocks and scales (a missing `_scales` is then reported missing by the loader)."""
    out: list[str] = []
    for name in names:
        if name not in files and name + PARTS[0] in files:
            out += [name + part for part in PARTS]
        else:
            out.append(name)
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] -> W [E, G * 32, R] in `dtype`.

    Exact in float32 and bfloat16 alike: every value is an E2M1 value times a power of two, computed
    in float32 (ldexp, as transformers' `convert_moe_packed_tensors`) and then cast. One expert at a
    time, so the temporary codes stay one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
            f"([E, R, G, {BLOCK // 2}] and [E, R, G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    e, r, g, _ = blocks.shape
    out = torch.empty(e, g * BLOCK, r, dtype=dtype)
    for x in range(e):
        codes = torch.stack((blocks[x] & 0x0F, blocks[x] >> 4), dim=-1)  # [R, G, 16, 2]: even, odd element
        values = table[codes.long()].view(r, g, BLOCK)
        values = torch.ldexp(values, scales[x].to(torch.int32)[..., None] - 127)
        out[x] = values.view(r, g * BLOCK).T
    return out


def dequantize_loaded(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Replace every `<name>_blocks`/`<name>_scales` pair in `tensors` by `<name>`, dequantized."""
    for blocks_name in [n for n in tensors if n.endswith(PARTS[0])]:
        name = blocks_name.removesuffix(PARTS[0])
        blocks, scales = tensors.pop(blocks_name), tensors.pop(name + PARTS[1])
        tensors[name] = dequantize(blocks, scales, dtype, name).to(device)
