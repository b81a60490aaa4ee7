"""The ModelOpt NVFP4 byte format: weight numerics bit-identical to ModelOpt's ``NVFP4QTensor`` (pure-torch
path), packing and reading back.

Per quantized linear with weight ``[out, in]`` (``in % 16 == 0``):

* ``weight`` uint8 ``[out, in / 2]``: two E2M1 codes per byte, the even input column in the low nibble;
* ``weight_scale`` float8_e4m3fn ``[out, in / 16]``: per-block scale
  ``fp8(clamp(block_amax / (6 * weight_scale_2), 2**-9, 448))``, all-zero blocks get 1.0;
* ``weight_scale_2`` fp32 scalar: ``amax / (6 * 448)``.

A code is ``sign << 3 | idx`` with ``idx`` indexing ``E2M1_GRID``; the dequantized weight is
``value(code) * (float(weight_scale) * weight_scale_2)``. Codes come from ``w / (float(weight_scale) * weight_scale_2)``
rounded to the nearest grid point, ties to the even mantissa, saturating at 6. All arithmetic is fp32
(bf16 / fp16 weights are upcast exactly).

An all-zero tensor has ``weight_scale_2 == 0``; as in ModelOpt, its block scales are then ``0 / 0`` (NaN) and
its codes saturate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK",
    "E2M1_GRID",
    "FP4_MAX",
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "NVFP4Weight",
    "as_fp32",
    "block_codes",
    "block_round",
    "block_scales",
    "check_input_scale",
    "check_weight",
    "dequant_blocks",
    "e2m1_codes",
    "e2m1_round",
    "e2m1_values",
    "global_scale",
    "input_scale",
    "pack_nibbles",
    "quantize_activations",
    "quantize_nvfp4",
    "raw_block_scales",
    "round_block_scales",
    "scalar_scale",
    "unpack_nibbles",
    "weight_blocks",
]

E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the E2M1 codes 0-7 (codes 8-15 are their negatives)."""
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_MIN_SCALE = 2.0**-9
"""Smallest block scale (the smallest positive FP8 E4M3 subnormal); smaller scales are raised to it."""
BLOCK = 16

_GLOBAL_DIVISOR = FP4_MAX * FP8_MAX  # 2688


def linear_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one NVFP4 linear as ModelOpt exports it: uint8 ``weight [out, in / 2]`` (two E2M1 codes per byte),
    float8 ``weight_scale [out, in / 16]`` and the fp32 scalars ``weight_scale_2`` and ``input_scale``."""
    return out_features * (in_features // 2) + out_features * -(-in_features // BLOCK) + 8


def as_fp32(x: torch.Tensor | float, device: torch.device | None = None) -> torch.Tensor:
    """``x`` as an fp32 tensor (on ``device`` when given)."""
    return torch.as_tensor(x, dtype=torch.float32, device=device)


def scalar_scale(weight_scale_2: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A global scale as a 0-d fp32 tensor on ``device``; ValueError unless it has one element."""
    s2 = as_fp32(weight_scale_2, device)
    if s2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got shape {tuple(s2.shape)}")
    return s2.reshape(())


def check_weight(w: torch.Tensor) -> None:
    """ValueError unless ``w`` is a floating ``[out, in]`` tensor with ``in % BLOCK == 0``."""
    if w.dim() != 2:
        raise ValueError(f"NVFP4 weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"NVFP4 weight must be floating point, got {w.dtype}")
    if w.shape[1] % BLOCK != 0:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {BLOCK}, got in={w.shape[1]}")


def weight_blocks(w: torch.Tensor) -> torch.Tensor:
    """fp32 view of ``w [out, in]`` as ``[out, in / BLOCK, BLOCK]``."""
    return w.float().reshape(w.shape[0], w.shape[1] // BLOCK, BLOCK)


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``weight_scale_2 = amax / (6 * 448)`` in fp32 (0 for amax 0, as ModelOpt)."""
    return as_fp32(amax) / _GLOBAL_DIVISOR


def input_scale(act_amax: torch.Tensor | float) -> torch.Tensor:
    """Static activation scale ``act_amax / (6 * 448)`` in fp32."""
    return as_fp32(act_amax) / _GLOBAL_DIVISOR


def raw_block_scales(block_amax: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Unrounded block scales ``block_amax / (6 * weight_scale_2)`` in fp32."""
    return block_amax / (FP4_MAX * weight_scale_2)


def round_block_scales(raw: torch.Tensor) -> torch.Tensor:
    """Zero scales to 1.0, clamp to ``[2**-9, 448]``, round to float8_e4m3fn (nearest-even)."""
    raw = torch.where(raw == 0, torch.ones_like(raw), raw)
    return raw.clamp(min=FP8_MIN_SCALE, max=FP8_MAX).to(torch.float8_e4m3fn)


def block_scales(
    w: torch.Tensor, weight_scale_2: torch.Tensor | float, shrink: torch.Tensor | None = None
) -> torch.Tensor:
    """float8_e4m3fn ``[out, in / 16]`` block scales of ``w [out, in]`` against ``weight_scale_2``.

    ``shrink`` (broadcastable to ``[out, in / 16]``) multiplies the unrounded scale before the FP8 rounding.
    """
    check_weight(w)
    s2 = scalar_scale(weight_scale_2, w.device)
    raw = raw_block_scales(weight_blocks(w).abs().amax(dim=-1), s2)
    if shrink is not None:
        raw = raw * as_fp32(shrink, w.device)
    return round_block_scales(raw)


@functools.cache
def _constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table, built once per dtype and device (a host-to-device copy per call would stall
    the GPU queue inside the block-scale search)."""
    return torch.tensor(values, dtype=dtype, device=device)


def _e2m1_magnitude(magnitude: torch.Tensor) -> torch.Tensor:
    """fp32 nearest E2M1 magnitude of fp32 ``magnitude >= 0``, ties to the even grid index, saturating at 6
    (NaN -> 6).

    The grid's step is 0.5 below 2, 1 from 2 to 4 and 2 above, so the magnitude is rounded half to even in units
    of its step (a power of two: the division is exact). The even multiples of each step are the even grid
    indices, so half-to-even in steps is ties to the even index; at the step changes (2 and 4) the grid value
    itself is the boundary, never a tie. Arithmetic rather than a midpoint table, as it runs on every block of
    every candidate scale in the block-scale search.
    """
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    rounded = (torch.round(magnitude / step) * step).clamp_(max=FP4_MAX)
    return torch.nan_to_num_(rounded, nan=FP4_MAX)


def _grid_index(value: torch.Tensor) -> torch.Tensor:
    """uint8 grid index (0-7) of E2M1 magnitudes ``value``: ``2 v`` below 2, ``v + 2`` below 4, ``v / 2 + 4``
    from 4 (0.5 -> 1, 2 -> 4, 3 -> 5, 6 -> 7)."""
    index = torch.where(value < 2.0, 2.0 * value, torch.where(value < 4.0, value + 2.0, value / 2.0 + 4.0))
    return index.to(torch.uint8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of ``x`` (already divided by its scales): ``sign << 3 | grid index``.

    Rounds ``x`` (as fp32) to the nearest grid magnitude with ties to even and saturates at 6 (NaN -> 6);
    ``-0.0`` has sign 0, a negative value that rounds to zero keeps sign 1 (code 8).
    """
    x = x.float()
    sign = (x < 0).to(torch.uint8)
    return (sign << 3) | _grid_index(_e2m1_magnitude(x.abs()))


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``e2m1_values(e2m1_codes(x))`` without the codes: ``x`` (as fp32) rounded onto the signed E2M1 grid,
    every bit equal to the decoded codes' (``-0.0`` for a negative value that rounds to zero, ``+0.0`` for
    ``-0.0``)."""
    x = x.float()
    magnitude = _e2m1_magnitude(x.abs())
    return torch.where(x < 0, -magnitude, magnitude)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 ``codes`` (uint8 in [0, 15])."""
    grid = _constant(tuple(E2M1_GRID), torch.float32, codes.device)
    table = torch.cat([grid, -grid])
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit ``codes [..., n]`` (n even) into uint8 ``[..., n / 2]``, even element in the low nibble."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"cannot pack an odd number of codes ({codes.shape[-1]}) into bytes")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 ``[..., n]`` to uint8 codes ``[..., 2 n]``."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def dequant_blocks(codes: torch.Tensor, scale_fp32: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 ``value(codes) * (scale * weight_scale_2)`` for ``codes [out, nb, 16]``, ``scale_fp32 [out, nb]``."""
    return e2m1_values(codes) * (scale_fp32 * weight_scale_2).unsqueeze(-1)


def block_codes(wb: torch.Tensor, scale_fp32: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """uint8 codes of fp32 blocks ``wb [out, nb, 16]`` under block scales ``scale_fp32 [out, nb]``."""
    return e2m1_codes(wb / (scale_fp32 * weight_scale_2).unsqueeze(-1))


def block_round(wb: torch.Tensor, scale_fp32: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 blocks ``wb [out, nb, 16]`` rounded onto their grids under block scales ``scale_fp32 [out, nb]``:
    ``dequant_blocks(block_codes(...))`` bit for bit, without building the codes."""
    step = (scale_fp32 * weight_scale_2).unsqueeze(-1)
    return e2m1_round(wb / step) * step


@dataclass
class NVFP4Weight:
    """One NVFP4-quantized weight in ModelOpt's export layout."""

    weight: torch.Tensor
    """uint8 ``[out, in / 2]`` packed E2M1 codes."""
    weight_scale: torch.Tensor
    """float8_e4m3fn ``[out, in / 16]`` block scales."""
    weight_scale_2: torch.Tensor
    """fp32 scalar global scale."""

    @property
    def shape(self) -> tuple[int, int]:
        """Shape ``(out, in)`` of the unquantized weight."""
        return self.weight.shape[0], self.weight.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]`` weight: ``value(code) * (float(weight_scale) * weight_scale_2)``, computed in fp32."""
        out, n = self.shape
        codes = unpack_nibbles(self.weight).reshape(out, n // BLOCK, BLOCK)
        deq = dequant_blocks(codes, self.weight_scale.float(), self.weight_scale_2.float())
        return deq.reshape(out, n).to(dtype)


def quantize_nvfp4(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor | float | None = None,
    block_scale: torch.Tensor | None = None,
) -> NVFP4Weight:
    """Quantize ``w [out, in]`` to NVFP4.

    ``weight_scale_2`` defaults to ``global_scale(w.abs().amax())``; a given one (e.g. shared across fused
    q/k/v or gate/up) is used as is. ``block_scale`` (float8_e4m3fn ``[out, in / 16]``, e.g. from
    ``search_block_scales``) defaults to ``block_scales(w, weight_scale_2)``.
    """
    check_weight(w)
    out, n = w.shape
    s2 = global_scale(w.abs().amax()).to(w.device) if weight_scale_2 is None else scalar_scale(weight_scale_2, w.device)
    if block_scale is None:
        block_scale = block_scales(w, s2)
    else:
        if block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"block_scale must be float8_e4m3fn, got {block_scale.dtype}")
        if tuple(block_scale.shape) != (out, n // BLOCK):
            raise ValueError(f"block_scale must have shape {(out, n // BLOCK)}, got {tuple(block_scale.shape)}")
        block_scale = block_scale.to(w.device)
    codes = block_codes(weight_blocks(w), block_scale.float(), s2).reshape(out, n)
    return NVFP4Weight(weight=pack_nibbles(codes), weight_scale=block_scale, weight_scale_2=s2)


def check_input_scale(input_scale: torch.Tensor | float) -> None:
    """ValueError unless ``input_scale`` is one positive finite value."""
    s = as_fp32(input_scale)
    if s.numel() != 1 or not (float(s) > 0 and math.isfinite(float(s))):
        raise ValueError(f"input_scale must be a positive finite number, got {input_scale!r}")


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """``x [..., in]`` (``in % 16 == 0``) as the NVFP4 GEMM reads it: quantized per 16 inputs and dequantized, in
    ``x.dtype``.

    Convention (ModelOpt's export, read the same way by SGLang's and vLLM's ``modelopt_fp4``): the checkpoint's
    ``input_scale`` is ``calibrated amax / (6 * 448)``; the engines pass ``1 / input_scale`` to the activation
    quantizer as its global scale. Per block of 16 inputs: block scale ``fp8_e4m3(clamp(block_amax / (6 *
    input_scale), 2**-9, 448))`` (round to nearest even; a block above the calibrated range saturates at 448),
    codes ``e2m1(x / (block_scale * input_scale))`` rounded to nearest with ties to the even mantissa and
    saturating at 6, value ``code * block_scale * input_scale``: the weights' numerics with ``input_scale`` as the
    global scale, as ModelOpt's ``NVFP4QTensor`` computes them. All arithmetic in fp32.

    ``input_scale`` must be positive and finite: checked here when it is a number; a tensor is checked once by its
    owner (``check_input_scale``), since reading it back on every call would stall a GPU.
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(f"activations must have a multiple of {BLOCK} inputs, got shape {list(x.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return x.clone()
    if not isinstance(input_scale, torch.Tensor):
        check_input_scale(input_scale)
    s2 = scalar_scale(input_scale, x.device)
    blocks = weight_blocks(flat)
    scale = round_block_scales(raw_block_scales(blocks.abs().amax(dim=-1), s2)).float()
    return block_round(blocks, scale, s2).reshape(x.shape).to(x.dtype)
