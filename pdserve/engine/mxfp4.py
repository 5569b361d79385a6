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

from collections.abc import Callable, Collection

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


Cut = tuple[int, int, int]
"""(dim, start, stop) of a dequantized [E, in, out] weight (`TPShard.tensor_slice`)."""


def weight_name(part: str) -> str:
    """`<name>_blocks` or `<name>_scales` -> `<name>`."""
    for suffix in PARTS:
        part = part.removesuffix(suffix)
    return part


def stored_index(cut: Cut) -> tuple[slice, ...]:
    """The index, into blocks [E, out, in / 32, 16] and scales [E, out, in / 32], of what holds `cut`
    of the dequantized weight: experts and outputs are whole stored rows; inputs are packed 32 to a
    block, so the blocks covering [start, stop) (`trim` drops the values outside it)."""
    dim, start, stop = cut
    if dim == 1:
        return (slice(None), slice(None), slice(start // BLOCK, -(-stop // BLOCK)))
    return (slice(None),) * {0: 0, 2: 1}[dim] + (slice(start, stop),)


def trim(weight: torch.Tensor, cut: Cut) -> torch.Tensor:
    """`weight`, dequantized from the blocks `stored_index(cut)` chose, narrowed to `cut`: along the
    inputs a slice need not be 32-aligned (e.g. 2880 / 4 ranks), its first block may begin before it."""
    dim, start, stop = cut
    if dim != 1:
        return weight
    offset = start % BLOCK
    return weight[:, offset : offset + stop - start].contiguous()


def dequantize_loaded(
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    cut_of: Callable[[str], Cut | None] | None = None,
) -> None:
    """Replace every `<name>_blocks`/`<name>_scales` pair in `tensors` by `<name>`, dequantized;
    `cut_of(name)`: the slice of it this process holds, the pair being the blocks `stored_index` read
    for it (tensor parallelism); None: whole."""
    for blocks_name in [n for n in tensors if n.endswith(PARTS[0])]:
        name = blocks_name.removesuffix(PARTS[0])
        blocks, scales = tensors.pop(blocks_name), tensors.pop(name + PARTS[1])
        weight = dequantize(blocks, scales, dtype, name)
        cut = cut_of(name) if cut_of is not None else None
        tensors[name] = (weight if cut is None else trim(weight, cut)).to(device)
