"""Two launches: ``_partial_kernel`` scores a slice of the keys for the G queries of one (row, KV head), keeping the
running maximum, the sum of exponentials and the weighted values in fp32 (online softmax); ``_merge_kernel`` rescales
the slices to a common maximum and divides, one program per query head and slice of the head dimension, all slices
in one tile. Both products run on the tensor cores in TF32 for 16-bit operands: bf16 and fp16 values are exact in
TF32, so the scores are exact products summed in fp32 and only the probabilities are rounded (to TF32, relative
2**-11) in ``P V``; fp32 operands use IEEE fp32 dot products, the reference's fp32 softmax over the same masked keys
up to the order of fp32 operations. A row whose keys are all masked gives NaN, as the reference's softmax over
``-inf`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import INTERPRET, cuda_facts

BLOCK_KEYS = 64
"""Keys scored per loop iteration of a program."""
MAX_SPLITS = 256
"""Most key slices per (row, KV head): the merge holds them all in one tile."""
MERGE_BLOCK_D = 32
"""Head-dimension columns per merge program."""


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
    HKV, C, G, per_split, scale,
    sq_b, sq_h, sq_g, sk_b, sk_c, sk_h, sv_b, sv_c, sv_h, sm_b, sm_h,
    D, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    in_d = d[None, :] < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=(g[:, None] < G) & in_d, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * per_split
    end = tl.minimum(start + per_split, C)
    for c0 in range(start, end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        inside = c < end
        keep = tl.load(mask_ptr + b * sm_b + h * sm_h + c, mask=inside, other=0) != 0
        k = tl.load(k_ptr + b * sk_b + c[:, None] * sk_c + h * sk_h + d[None, :], mask=inside[:, None] & in_d,
                    other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: every term below is 0
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        v = tl.load(v_ptr + b * sv_b + c[:, None] * sv_c + h * sv_h + d[None, :], mask=inside[:, None] & in_d,
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    part = bh * tl.num_programs(1) + split
    tl.store(m_ptr + part * BLOCK_G + g, m_i)
    tl.store(l_ptr + part * BLOCK_G + g, l_i)
    tl.store(acc_ptr + (part * BLOCK_G + g[:, None]) * BLOCK_D + d[None, :], acc)


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, HKV, SPLITS, so_b, so_h, so_g, D,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, ROW: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    s = tl.arange(0, BLOCK_S)
    inside = s < SPLITS
    part = bh * SPLITS + s
    m = tl.load(m_ptr + part * BLOCK_G + g, mask=inside, other=float("-inf"))
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # 0 for slices that kept no key
    total = tl.sum(w * tl.load(l_ptr + part * BLOCK_G + g, mask=inside, other=0.0), axis=0)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + (part[:, None] * BLOCK_G + g) * ROW + d[None, :], mask=inside[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + b * so_b + h * so_h + g * so_g + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _splits(heads: int, keys: int, device: torch.device) -> int:
    """Key slices per (row, KV head): about two programs per SM over all heads, at least one block of keys each."""
    blocks = triton.cdiv(keys, BLOCK_KEYS)
    if device.type != "cuda" or INTERPRET:
        return min(blocks, 2)
    sms = cuda_facts(device)[0]
    return max(1, min(blocks, triton.cdiv(2 * sms, heads), MAX_SPLITS))


def masked_decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """``softmax(q k^T * scale, masked) v`` for ``q [B, Hkv, G, D]`` (a KV head's G query heads), ``k, v
    [B, C, Hkv, D]`` (the static cache's layout, any strides with unit stride in D) and ``mask [B, Hkv, C]`` (True:
    attend); returns ``[B, Hkv, G, D]`` in ``q.dtype``."""
    b, hkv, g, d = q.shape
    c = k.shape[1]
    if k.shape != (b, c, hkv, d) or v.shape != k.shape or mask.shape != (b, hkv, c):
        raise ValueError(
            f"expected q [B, Hkv, G, D], k and v [B, C, Hkv, D], mask [B, Hkv, C]; got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}, {list(mask.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in the head dimension")
    keep = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)  # an expanded mask stays a view
    block_g = max(16, triton.next_power_of_2(g))
    splits = _splits(b * hkv, c, q.device)
    per_split = triton.cdiv(triton.cdiv(c, splits), BLOCK_KEYS) * BLOCK_KEYS
    splits = triton.cdiv(c, per_split)
    m = torch.empty(b * hkv * splits * block_g, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    row = max(16, triton.next_power_of_2(d))  # the head dimension padded to a power of two, at least a dot's 16
    acc = torch.empty(b * hkv * splits * block_g * row, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hkv, g, d, dtype=q.dtype, device=q.device)
    _partial_kernel[(b * hkv, splits)](
        q, k, v, keep, m, l_sum, acc, hkv, c, g, per_split, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), keep.stride(0), keep.stride(1),
        d, BLOCK_G=block_g, BLOCK_C=BLOCK_KEYS, BLOCK_D=row, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    block_d = min(row, MERGE_BLOCK_D)
    _merge_kernel[(b * hkv, g, row // block_d)](
        m, l_sum, acc, out, hkv, splits, out.stride(0), out.stride(1), out.stride(2), d,
        BLOCK_G=block_g, BLOCK_S=triton.next_power_of_2(splits), ROW=row, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out
