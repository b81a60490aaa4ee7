"""GPTQ v1 tensor layout: int32 packing of codes and zeros, and its inverse.

Per quantized linear with ``in`` input and ``out`` output features, ``groups`` groups:

* ``qweight`` int32 ``[in * bits / 32, out]``: codes packed LSB-first along the input dim (input row
  ``p * r + j`` lands in bits ``[bits * j, bits * (j + 1))`` of ``qweight[r]``, ``p = 32 / bits``);
* ``qzeros`` int32 ``[groups, out * bits / 32]``: ``zero - 1`` packed LSB-first along the output dim
  (the v1 convention; loaders add the 1 back, ``gptq_marlin`` ignores qzeros for symmetric weights);
* ``scales`` fp16 ``[groups, out]`` and ``g_idx`` int32 ``[in]`` (group of each input row).

Dequantized weight: ``W[o, i] = (codes[o, i] - zero) * scales[g_idx[i], o]``.
"""

from __future__ import annotations

import torch

__all__ = [
    "SUPPORTED_BITS",
    "dequantize_gptq_v1",
    "linear_bytes",
    "pack_factor",
    "pack_gptq_v1",
    "unpack_gptq_v1",
]

SUPPORTED_BITS = (4, 8)
_WORD_BITS = 32


def pack_factor(bits: int) -> int:
    """Values per int32 word for ``bits``; ValueError unless bits is 4 or 8."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported by the GPTQ v1 packer; supported: 4, 8")
    return _WORD_BITS // bits


def linear_bytes(out_features: int, in_features: int, bits: int, group_size: int) -> int:
    """Bytes of one quantized linear's four tensors: ``qweight`` and ``qzeros`` packed ``bits`` per value into
    int32, fp16 ``scales`` and int32 ``g_idx`` (``group_size`` -1: one group over all inputs)."""
    p = pack_factor(bits)
    groups = -(-in_features // group_size) if group_size > 0 else 1
    qweight = -(-in_features // p) * out_features * 4
    qzeros = groups * -(-out_features // p) * 4
    return qweight + qzeros + groups * out_features * 2 + in_features * 4


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret int64 values in [0, 2**32) as int32 (words with bit 31 set become negative)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _to_uint32(words: torch.Tensor) -> torch.Tensor:
    """int32 words as int64 values in [0, 2**32)."""
    return words.to(torch.int64) & 0xFFFFFFFF


def _pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``values [m, n]`` along dim 1, LSB-first: int32 ``[m, n / p]``."""
    p = _WORD_BITS // bits
    words = values[:, 0::p].to(torch.int64)
    for j in range(1, p):
        words |= values[:, j::p].to(torch.int64) << (bits * j)
    return _to_int32(words)


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack int32 words ``[r, m]`` along dim 0, LSB-first: int64 ``[r * p, m]``."""
    p = _WORD_BITS // bits
    r, m = words.shape
    shifts = (torch.arange(p, dtype=torch.int64, device=words.device) * bits).view(1, p, 1)
    parts = (_to_uint32(words).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return parts.reshape(r * p, m)


def _require_int(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def pack_gptq_v1(
    codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int, zero: int
) -> dict[str, torch.Tensor]:
    """Pack one linear into the GPTQ v1 tensors ``qweight``, ``qzeros``, ``scales`` (fp16), ``g_idx``.

    ``codes`` is ``[out, in]`` with unsigned values in ``[0, 2**bits - 1]``, ``scales`` ``[groups, out]``,
    ``g_idx`` ``[in]`` with values in ``[0, groups)`` and ``zero`` the (symmetric) integer zero point;
    qzeros store ``zero - 1`` in every position.
    """
    p = pack_factor(bits)
    maxq = (1 << bits) - 1
    _require_int("codes", codes)
    _require_int("g_idx", g_idx)
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [out, in], got shape {list(codes.shape)}")
    out_f, in_f = codes.shape
    if in_f == 0 or out_f == 0:
        raise ValueError(f"codes shape {list(codes.shape)} is empty")
    if in_f % p:
        raise ValueError(f"in_features={in_f} must be a multiple of {p} (32 / bits) for {bits}-bit packing")
    if out_f % p:
        raise ValueError(f"out_features={out_f} must be a multiple of {p} (32 / bits) for {bits}-bit qzeros")
    if scales.dim() != 2 or scales.shape[1] != out_f or scales.shape[0] == 0:
        raise ValueError(f"scales must be [groups, out={out_f}], got shape {list(scales.shape)}")
    groups = scales.shape[0]
    if g_idx.shape != (in_f,):
        raise ValueError(f"g_idx must have shape [in={in_f}], got {list(g_idx.shape)}")
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi > maxq:
        raise ValueError(f"codes must lie in [0, {maxq}] for {bits}-bit, got values in [{lo}, {hi}]")
    g_lo, g_hi = int(g_idx.min()), int(g_idx.max())
    if g_lo < 0 or g_hi >= groups:
        raise ValueError(f"g_idx values must lie in [0, {groups}) (scales rows), got [{g_lo}, {g_hi}]")
    if isinstance(zero, bool) or not 1 <= int(zero) <= maxq + 1:
        raise ValueError(f"zero={zero!r} must lie in [1, {maxq + 1}]: v1 stores zero - 1 in {bits} bits")
    scales16 = scales.detach().to(device="cpu", dtype=torch.float16)
    if not bool(torch.isfinite(scales16).all()):
        raise ValueError("scales are not finite in fp16 (overflow or NaN)")

    qweight = _pack_cols(codes.detach(), bits).t().contiguous().cpu()  # packs where the codes are: 8x less to copy
    qzeros = _pack_cols(torch.full((groups, out_f), int(zero) - 1, dtype=torch.int64), bits)
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales16.contiguous(),
        "g_idx": g_idx.detach().to(device="cpu", dtype=torch.int32).contiguous(),
    }


def unpack_gptq_v1(
    qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``qweight``/``qzeros`` into codes ``[out, in]`` int32 and true zeros ``[groups, out]`` int32, on the
    device they are on.

    The true zero is the stored v1 value plus one.
    """
    p = pack_factor(bits)
    if in_features % p or out_features % p:
        raise ValueError(f"in_features={in_features} and out_features={out_features} must be multiples of {p}")
    expected_w = (in_features // p, out_features)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != expected_w:
        raise ValueError(f"qweight must be int32 {list(expected_w)}, got {qweight.dtype} {list(qweight.shape)}")
    if qzeros.dtype != torch.int32 or qzeros.dim() != 2 or qzeros.shape[1] != out_features // p:
        raise ValueError(f"qzeros must be int32 [groups, {out_features // p}], got {qzeros.dtype} {list(qzeros.shape)}")
    codes = _unpack_rows(qweight, bits).t().contiguous().to(torch.int32)
    zeros = (_unpack_rows(qzeros.to(qweight.device).t().contiguous(), bits).t() + 1).contiguous().to(torch.int32)
    return codes, zeros


def dequantize_gptq_v1(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Float32 weight ``[out, in]`` from the GPTQ v1 tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``), on
    ``qweight``'s device."""
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        if key not in tensors:
            raise ValueError(f"GPTQ tensors lack {key!r}")
    device = tensors["qweight"].device
    g_idx = tensors["g_idx"].to(device, torch.int64)
    scales = tensors["scales"].to(device, torch.float32)
    if g_idx.dim() != 1 or scales.dim() != 2:
        raise ValueError(f"g_idx must be 1-D and scales 2-D, got {list(g_idx.shape)} and {list(scales.shape)}")
    in_f, out_f = g_idx.numel(), scales.shape[1]
    codes, zeros = unpack_gptq_v1(tensors["qweight"], tensors["qzeros"], bits, in_f, out_f)
    if zeros.shape[0] != scales.shape[0]:
        raise ValueError(f"qzeros has {zeros.shape[0]} groups but scales has {scales.shape[0]}")
    if in_f and (int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"g_idx values must lie in [0, {scales.shape[0]})")
    z = zeros.to(torch.float32)[g_idx].t()
    s = scales[g_idx].t()
    return (codes.to(torch.float32) - z) * s
