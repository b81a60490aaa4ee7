"""GPU time of GPTQ rounding for NVFP4 on one linear (``salaquant.nvfp4.gptq.gptq_nvfp4``) at SALA's shapes.

Random heavy-tailed weights and a Hessian of 4,096 random correlated tokens, fp32 on one GPU. Timed: block scales
chosen during the sweep on the fused kernel (search and sweep share a launch per block of columns) with scales
from 0.4 to 1.5 times the plain one (``--mse-max-grow 1.5``), the same below the plain scale only (the default,
``mse_max_grow=1``), the grown search with the search and the sweep alternating every 16 columns (the path before
the fused kernel, kept as the PyTorch search plus the Triton sweep), and block scales fixed before the sweep. The
alternating run's bytes are compared with the fused run's.

  python benchmarks/nvfp4_gptq_speed.py --out OUT
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import write_results

import salaquant.nvfp4.gptq as nvfp4_gptq
from salaquant.nvfp4.search import search_block_scales, searched_global_scale

SHAPES = {"o_proj": (4096, 4096), "down": (4096, 16384)}  # (out, in)
GROW = 1.5  # the grown scales' largest block scale, times the plain one (--mse-max-grow 1.5)


def _operands(out: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(out, n, device="cuda", generator=g)
    w = w * torch.exp(0.5 * torch.randn(out, n, device="cuda", generator=g))
    x = torch.randn(4096, n, device="cuda", generator=g)
    x = x + 0.3 * torch.roll(x, 1, dims=1)  # neighbouring inputs correlated
    return w * 0.02, x.T @ x / x.shape[0]


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for name, (out, n) in SHAPES.items():
        w, h = _operands(out, n)
        ws2, imp = searched_global_scale(w.abs().amax(), GROW), torch.diag(h)
        nvfp4_gptq.gptq_nvfp4(w[:64, :256], h[:256, :256], ws2, imp[:256])  # compile the kernels

        def run(w: torch.Tensor = w, h: torch.Tensor = h, ws2: torch.Tensor = ws2, imp: torch.Tensor = imp) -> object:
            return nvfp4_gptq.gptq_nvfp4(w, h, ws2, imp, mse_max_grow=GROW)

        fused_s, fused = _timed(run)
        shrunk_s, _ = _timed(
            lambda w=w, h=h, imp=imp: nvfp4_gptq.gptq_nvfp4(
                w, h, searched_global_scale(w.abs().amax(), 1.0), imp, mse_max_grow=1.0
            )
        )
        fused_on_triton = nvfp4_gptq.sweep_on_triton
        nvfp4_gptq.sweep_on_triton = lambda *_: False  # the search and the sweep alternating
        try:
            alt_s, alt = _timed(run)
        finally:
            nvfp4_gptq.sweep_on_triton = fused_on_triton
        scales = search_block_scales(w, ws2, imp, max_grow=GROW).scales
        static_s, _ = _timed(
            lambda w=w, h=h, ws2=ws2, imp=imp, s=scales: nvfp4_gptq.gptq_nvfp4(w, h, ws2, imp, block_scale=s)
        )
        same = fused.weight.weight_scale.view(torch.uint8) == alt.weight.weight_scale.view(torch.uint8)
        row = {
            "linear": name,
            "shape": [out, n],
            "fused_s": round(fused_s, 3),
            "fused_shrunk_only_s": round(shrunk_s, 3),
            "alternating_s": round(alt_s, 3),
            "static_scales_s": round(static_s, 3),
            "speedup": round(alt_s / fused_s, 1),
            "scales_equal": float(same.float().mean()),
            "loss_rel_diff": abs(fused.loss - alt.loss) / alt.loss,
        }
        print(row, flush=True)
        rows.append(row)
    write_results(args.out, "nvfp4_gptq_speed.json", {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
