"""Time the NVFP4 block-scale search two ways on one weight: every shrink factor (80 passes by default) and every
FP8 value the factors reach (what ``search_block_scales`` runs when the factors are fine enough). Prints both
times, their ratio, the number of passes and whether the chosen scales are identical.

  python benchmarks/studies/nvfp4_search_passes.py [--out 2048] [--in 4096] [--device cpu|cuda] [--iters 80]
      [--max-shrink 0.6]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from salaquant.formats.modelopt_nvfp4 import numerics as nv
from salaquant.nvfp4 import search


def _timed(fn, device: torch.device) -> tuple[float, tuple[torch.Tensor, ...]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=int, default=2048)
    ap.add_argument("--in", dest="inp", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=80)
    ap.add_argument("--max-shrink", type=float, default=0.6)
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    # heavy-tailed weights (log-normal magnitudes), as trained linears have outliers
    w = torch.randn(args.out, args.inp, generator=gen) * torch.exp(torch.randn(args.out, args.inp, generator=gen))
    w = (w * 0.01).to(device)
    imp = torch.rand(args.inp, generator=gen).to(device)
    s2 = nv.scalar_scale(nv.global_scale(w.abs().amax()), device)
    wb = nv.weight_blocks(w)
    raw = nv.raw_block_scales(wb.abs().amax(dim=-1), s2)
    impb = imp.reshape(1, -1, nv.BLOCK)
    factors = search.shrink_factors(args.iters, args.max_shrink)
    search._search_fp8_values(wb[:8], raw[:8], impb, s2, factors[-1])  # warm-up (allocator, kernels)
    t_factors, a = _timed(lambda: search._search_factors(wb, raw, impb, s2, factors), device)
    t_values, b = _timed(lambda: search._search_fp8_values(wb, raw, impb, s2, factors[-1]), device)
    hi = nv.round_block_scales(raw).view(torch.uint8).int()
    lo = nv.round_block_scales(raw * factors[-1]).view(torch.uint8).int()
    print(
        json.dumps(
            {
                "shape": [args.out, args.inp],
                "device": str(device),
                "factor_passes": len(factors),
                "fp8_value_passes": int((hi - lo).max()) + 1,
                "every_factor_s": round(t_factors, 3),
                "fp8_values_s": round(t_values, 3),
                "speedup": round(t_factors / t_values, 2),
                "identical_scales": bool(torch.equal(a[0], b[0])),
                "identical_errors": bool(torch.equal(a[1], b[1])),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
