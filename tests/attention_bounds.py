"""Elementwise error bounds for attention kernels that keep an fp32 online softmax over fp16 or bf16 inputs: an fp64
reference of block-sparse attention that also returns what the bound is made of, and the bound itself.

The kernel and the reference read the same fp16/bf16 ``q, k, v``, so rounding the inputs costs nothing; what
differs is the kernel's arithmetic. Per output ``o_d = sum_i P_i v_id`` (``P`` the row's softmax over its
visible selected keys) the kernel's error is at most, to first order in the unit roundoffs:

- ``u * (P|V|)_d``: the probabilities are rounded to the input dtype before the ``P @ V`` dot (``u`` its unit
  roundoff), while the normalizer sums them in fp32;
- ``(exp(2 eps) - 1) * (P|V|)_d``: each logit is off by at most ``eps`` nats (the fp32 dot of ``D`` exact products,
  the scaling, the max subtraction, ``exp2``, and the log-sum-exp of every partial result that is merged), and
  perturbing each logit by at most ``eps`` moves every normalized weight by a factor within ``exp(+-2 eps)``;
- ``2 n u32 * (P|V|)_d``: the fp32 sums of the numerator and of the normalizer over ``n`` steps (a key tile's dot,
  the rescale by ``alpha``, the merge of split or sliding-window partial results), bounded by ``P|V|`` and not by
  ``|o|`` because partial results can cancel in a merge;
- ``tiny * max(P) * (M|V|)_d``: a probability below the dtype's smallest normal rounds to a multiple of its smallest
  subnormal (``M`` the row's visible keys, ``max(P) = 1 / l`` in the kernel's units);
- ``u * |o_d|``: the output is rounded to the input dtype, which with the factor ``1 + u`` on the whole bound also
  covers that rounding's effect on the error itself.

``u32 = 2**-23`` per fp32 operation, one ulp rather than half: tensor cores add their products by truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
"""Unit roundoff of a round-to-nearest conversion from fp32 (GPUs, and the interpreter's fp16)."""
UNDERFLOW = {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-126}
"""Largest error of rounding a probability in ``[0, 1]``: half of fp16's smallest subnormal; for bf16 (fp32's
exponent range) fp32's smallest normal, which also covers flushing subnormals to zero."""
FP32_OP = 2.0**-23


@dataclass(frozen=True)
class AttentionReference:
    """fp64 attention of each query over its visible selected keys, and the pieces of its error bound, each
    ``[B, Tq, Hq, D]`` (``logit_error`` ``[B, Tq, Hq, 1]``)."""

    out: Tensor
    """``P @ V``."""
    abs_out: Tensor
    """``P @ |V|``: the scale of every rounding error of the weighted sum."""
    underflow: Tensor
    """``max(P) * (M @ |V|)``: what probabilities rounded into the subnormal range can move."""
    logit_error: Tensor
    """Most error of one logit in nats, from the fp32 dot ``sum_d |q_d k_d|`` over the row's keys."""


def block_sparse_reference(
    q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, q_start: int, block_size: int, query_chunk: int = 64
) -> AttentionReference:
    """The reference's ``block_sparse_attention`` (the query at ``q_start + i`` attends the keys ``s <= q_start + i``
    of its selected blocks, ``-1`` and out-of-range entries ignored, no key left gives zeros) in fp64, with the
    quantities ``attention_bound`` needs. ``q: [B, Tq, Hq, D]``, ``k, v: [B, Tk, Hkv, D]``,
    ``block_idx: [B, Hkv, Tq, S]``; scale ``1 / sqrt(D)``."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    n_blocks = -(-tk // block_size)
    qg = q.double().reshape(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Tq, D]
    kt = k.double().permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, Tk]
    vd = v.double().transpose(1, 2)[:, :, None]  # [B, Hkv, 1, Tk, D]
    key_pos = torch.arange(tk, device=q.device)
    key_block = key_pos // block_size
    parts: list[list[Tensor]] = [[], [], [], []]
    for c0 in range(0, tq, query_chunk):
        c1 = min(tq, c0 + query_chunk)
        idx = block_idx[:, :, c0:c1].long()
        idx = torch.where((idx >= 0) & (idx < n_blocks), idx, n_blocks)  # a spare slot for the ignored entries
        chosen = torch.zeros(*idx.shape[:3], n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, idx, True)
        pos = q_start + torch.arange(c0, c1, device=q.device)
        mask = (chosen[..., key_block] & (key_pos[None, :] <= pos[:, None]))[:, :, None]  # [B, Hkv, 1, tc, Tk]
        qc = qg[:, :, :, c0:c1]
        logits = (qc @ kt).mul_(scale).masked_fill_(~mask, -math.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        del logits
        parts[0].append(probs @ vd)
        parts[1].append(probs @ vd.abs())
        parts[2].append(probs.amax(dim=-1, keepdim=True) * (mask.double() @ vd.abs()))
        del probs
        abs_dot = (qc.abs() @ kt.abs()).masked_fill_(~mask, 0.0).amax(dim=-1, keepdim=True) * scale
        parts[3].append(abs_dot)

    def heads_last(chunks: list[Tensor]) -> Tensor:  # [B, Hkv, G, Tq, X] -> [B, Tq, Hq, X]
        x = torch.cat(chunks, dim=3)
        return x.permute(0, 3, 1, 2, 4).reshape(b, tq, hq, x.shape[-1])

    return AttentionReference(*(heads_last(p) for p in parts))


def attention_bound(ref: AttentionReference, dtype: torch.dtype, head_dim: int, n_keys: int, steps: int) -> Tensor:
    """Elementwise bound on ``|kernel - ref.out|`` (module docstring) for a kernel over ``dtype`` inputs of head
    dimension ``head_dim``, at most ``n_keys`` keys per row and at most ``steps`` fp32 accumulation steps per
    output."""
    u = ROUNDING[dtype]
    # logit: D-term dot and its scaling (D + 2 roundings of sum |q_d k_d|), max subtraction and exp2 (a few more
    # of the logit's size), log-sum-exps of merged partial results (of log(n_keys) and the logit's size)
    eps = FP32_OP * ((head_dim + 8) * ref.logit_error + 4 * math.log(max(n_keys, 2)) + 8)
    rel = u + torch.expm1(2 * eps) + 2 * steps * FP32_OP
    bound = rel * ref.abs_out + UNDERFLOW[dtype] * ref.underflow + u * ref.out.abs()
    return bound * (1 + u)
