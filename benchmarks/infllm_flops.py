"""Arithmetic of InfLLM-v2 prefill against dense causal attention: how much faster sparse attention can be at most
when both run at the same FLOP rate.

Counts multiply-adds (2 FLOPs each) per query head over all query positions ``p < T``:

* dense causal: ``q k`` and ``p v`` over the ``p + 1`` keys, ``4 D (p + 1)``;
* stage 1: the scores of ``q`` against every complete K1 window (``kernel_size`` keys, stride ``kernel_stride``)
  and every K2 window (4x both) ending at or before ``p``, ``2 D`` each (scores only; the log-sum-exp and pooling
  are not counted);
* stage 2: ``4 D`` per key of the ``min(topk + local_blocks, p // block_size + 1)`` selected blocks, the query's
  own block only up to ``p``.

Selection and compression cost nothing here, so the ratio is an upper bound on the speedup of any implementation
whose kernels reach the dense kernel's FLOP rate.

  python benchmarks/infllm_flops.py [--t 131072] [--head-dim 128]
"""

from __future__ import annotations

import argparse

import torch

from salaquant.model.sparse_attention import SparseParams


def flops_per_head(t: int, d: int, params: SparseParams) -> dict[str, float]:
    p = torch.arange(t, dtype=torch.float64)
    dense = 4 * d * (p + 1)
    k1 = torch.clamp(torch.div(p - params.kernel_size + 1, params.kernel_stride, rounding_mode="floor") + 1, min=0)
    k2 = torch.clamp(torch.div(p - params.kernel_size2 + 1, params.kernel_stride2, rounding_mode="floor") + 1, min=0)
    stage1 = 2 * d * (k1 + k2)
    blocks = torch.clamp(torch.div(p, params.block_size, rounding_mode="floor") + 1, max=params.total_topk)
    keys = (blocks - 1) * params.block_size + torch.remainder(p, params.block_size) + 1
    stage2 = 4 * d * keys
    return {"dense": float(dense.sum()), "stage1": float(stage1.sum()), "stage2": float(stage2.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=131072)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    params = SparseParams()
    f = flops_per_head(args.t, args.head_dim, params)
    sparse = f["stage1"] + f["stage2"]
    print(
        f"T={args.t}, D={args.head_dim}, {params}: per query head dense {f['dense']:.3e} FLOPs, sparse "
        f"{sparse:.3e} (stage 1 {f['stage1'] / sparse:.0%}, stage 2 {f['stage2'] / sparse:.0%}); "
        f"dense / sparse = {f['dense'] / sparse:.2f}x, dense / stage 2 alone = {f['dense'] / f['stage2']:.2f}x"
    )


if __name__ == "__main__":
    main()
