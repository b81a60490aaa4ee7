"""Steps of the block selection's two searches for the k-th pooled score, on decode rows of stage-1 scores.

A PyTorch model of ``interpolated_kth`` and of the bit search of ``pool_select`` (the same brackets, candidates
and stopping rules, one count or one reduction per step) runs on the pooled scores of one decode query (GQA 32:2,
head_dim 128, SALA's sparse settings, random keys) at ``--seq`` tokens, for ``--seeds`` key draws, and reports
how many dependent reduction steps each takes per row; each result is checked against ``torch.topk``. CPU only.

  python benchmarks/select_steps.py --out OUT.json [--seq 131072] [--seeds 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from results import write_results

from salaquant.model import sparse_attention as ref
from salaquant.model.sparse_attention import SparseParams

MARGIN = 0.05  # INTERP_MARGIN


def images(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int images of fp32 scores (as int64)."""
    bits = x.float().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()


def _target(lo: int, width: int, c_lo: int, c_hi: int, target: float) -> int:
    frac = min(max((c_lo - target) / (c_lo - c_hi), 0.0), 1.0)
    return lo + min(max(int(width * frac), 1), width - 1)


def interpolation_steps(img: torch.Tensor, forced: torch.Tensor, k: int) -> tuple[int, int, int]:
    """``(steps, v, count)`` of the interpolation search (see ``interpolated_kth``)."""
    lo, c_lo, n_forced = int(img.min()), len(img), int(forced.sum())
    hi, c_hi = (int(img[~forced].max()) + 1, n_forced) if n_forced < k else (int(img.max()) + 1, 0)
    bisect, steps = False, 0
    while hi - lo > 1 and c_lo != k:
        width = hi - lo
        if bisect:
            a, b = lo + max(width // 3, 1), lo + min(max(2 * width // 3, 1), width - 1)
        else:
            margin = max(MARGIN * (c_lo - c_hi), 1.0)
            a = _target(lo, width, c_lo, c_hi, k + 0.5 + margin)
            b = _target(lo, width, c_lo, c_hi, k + 0.5 - margin)
        inside = img[(img >= lo) & (img < hi)]
        n_a, n_b = int((img >= a).sum()), int((img >= b).sum())
        steps += 1
        if n_b >= k:
            lo, c_lo = b, n_b
        elif n_a >= k:
            lo, c_lo, hi, c_hi = a, n_a, b, n_b
        else:
            hi, c_hi = a, n_a
        lo, hi = max(lo, int(inside.min())), min(hi, int(inside.max()) + 1)
        bisect = 2 * (hi - lo) > width
    return steps, lo, c_lo


def bit_steps(img: torch.Tensor, k: int) -> tuple[int, int, int]:
    """``(steps, v, count)`` of the bit search: up to 32 counts, ending once one lands on ``k``."""
    v, count, steps = -(2**31), len(img), 0
    while steps < 32 and count != k:
        cand = v + (1 << (31 - steps))
        n_ge = int((img >= cand).sum())
        if n_ge >= k:
            v, count = cand, n_ge
        steps += 1
    return steps, v, count


def _check(img: torch.Tensor, k: int, v: int, count: int) -> None:
    kth = int(torch.topk(img, k).values[-1])
    if count != int((img >= v).sum()) or not (count == k or v == kth):
        raise AssertionError(f"search ended at {v} (count {count}); the k-th largest is {kth}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or a folder for select_steps.json)")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    p, t = SparseParams(), args.seq
    q_start = t - 1
    rows = []
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        k = torch.randn(1, t, 2, 128)
        q = torch.randn(1, 1, 32, 128)
        k1 = ref.compress_keys(k, p.kernel_size, p.kernel_stride)
        k2 = ref.compress_keys(k, p.kernel_size2, p.kernel_stride2)
        pooled = ref.block_scores(ref.stage1_scores(q, k1, k2, q_start, p), q_start, t, p)[0, :, 0]
        n_blocks = pooled.shape[-1]
        k_sel = min(p.total_topk, n_blocks)
        blocks = torch.arange(n_blocks)
        qb = q_start // p.block_size
        forced = (blocks < p.init_blocks) | ((blocks >= qb - p.local_blocks) & (blocks <= qb))
        for head in range(pooled.shape[0]):
            img = images(torch.where(forced, float("inf"), pooled[head]))
            s_i, v_i, c_i = interpolation_steps(img, forced, k_sel)
            s_b, v_b, c_b = bit_steps(img, k_sel)
            _check(img, k_sel, v_i, c_i)
            _check(img, k_sel, v_b, c_b)
            rows.append({"seed": seed, "kv_head": head, "interpolation_steps": s_i, "bit_steps": s_b})
            print(f"seed {seed} head {head}: interpolation {s_i} steps, bit search {s_b}")
    write_results(args.out, "select_steps.json", {"seq": t, "rows": rows})


if __name__ == "__main__":
    main()
