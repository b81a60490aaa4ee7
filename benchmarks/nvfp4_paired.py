"""The NVFP4 one-row GEMV (``nvfp4.paired_gemv``) against cuBLAS bf16 ``F.linear`` on the SALA shapes, on a GPU.

For each shape and activation dtype: CUDA-graph medians (4 weight copies, as ``kernels_nvfp4.py`` times them) of
the default launch and of cuBLAS, the error against the fp64 product of the dequantized weight, and whether the
PTX equals its emulation bit for bit. ``--sweep`` (bf16) also times every tile of ``SWEEP`` with and without the
prefetch of the next K tile, at each split count of ``--splits`` that leaves every split a K tile.

  python benchmarks/nvfp4_paired.py --out OUT [--sweep] [--shapes gate_up down] [--splits 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_nvfp4 import SHAPES, _nvfp4_copies, _time_us
from results import write_results
from salaquant.kernels.nvfp4 import dequantize
from salaquant.kernels.nvfp4 import triton_kernels as tk

SWEEP = [
    (128, 256, 4),
    (64, 256, 4),
    (64, 512, 4),
    (32, 256, 2),
    (32, 512, 4),
    (128, 128, 4),
    (256, 256, 8),
    (64, 256, 2),
    (32, 256, 4),
    (16, 512, 2),
    (16, 1024, 4),
    (32, 1024, 4),
    (32, 512, 8),
    (64, 1024, 8),
]
"""(block_n, block_k, warps) tiles ``--sweep`` times, each with and without prefetch at every split count."""


def bench(
    name: str, k: int, n: int, dtype: torch.dtype, sweep: bool, splits: list[int], tiles: list[tuple[int, ...]]
) -> dict:
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    copies = _nvfp4_copies(k, n)
    dense = [dequantize(*c).to(dtype).contiguous() for c in copies]
    exact = x.double() @ dequantize(*copies[0]).double().t()

    def err(y: torch.Tensor) -> float:
        return float((y.double() - exact).abs().max() / exact.abs().max())

    got = tk.nvfp4_matmul_triton(x, *copies[0])
    tk._EMULATE_PAIRED = True
    try:
        emulated = tk.nvfp4_matmul_triton(x, *copies[0])
    finally:
        tk._EMULATE_PAIRED = False
    cfg = tk.default_config(1, n, k, "cuda", dtype)
    row: dict = {
        "layer": name,
        "K": k,
        "N": n,
        "dtype": str(dtype).removeprefix("torch."),
        "default": str(cfg),
        "err": err(got),
        "err_cublas": err(F.linear(x, dense[0])),
        "ptx_equals_emulation": bool(torch.equal(got, emulated)),
        "cublas_us": _time_us([lambda d=d: F.linear(x, d) for d in dense]),
        "paired_us": _time_us([lambda c=c: tk.nvfp4_matmul_triton(x, *c) for c in copies]),
    }
    row["speedup"] = row["cublas_us"] / row["paired_us"]
    row["TBps"] = (n * k // 2 + n * k // 16) / row["paired_us"] / 1e6
    if sweep:
        configs: dict[str, object] = {}
        for bn, bk, warps in tiles:
            for split in (s for s in splits if s <= k // bk):
                for prefetch in (False, True):
                    c = tk.NVFP4Config("paired", block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                                       num_stages=1, prefetch=prefetch)  # fmt: skip
                    label = f"bn{bn}_bk{bk}_w{warps}_s{split}" + ("_pf" if prefetch else "")
                    try:
                        configs[label] = _time_us(
                            [lambda cp=cp, c=c: tk.nvfp4_matmul_triton(x, *cp, config=c) for cp in copies], quick=True
                        )
                    except Exception as exc:  # a failing launch is reported, the rest still run
                        configs[label] = f"failed: {type(exc).__name__}: {exc}"[:200]
        timed = {key: v for key, v in configs.items() if isinstance(v, float)}
        best = min(timed, key=timed.__getitem__)
        row["sweep_us"] = configs
        row["best"] = best
        row["best_us"] = timed[best]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    ap.add_argument("--splits", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--tiles", nargs="*", default=None, help="only these SWEEP tiles, as BNxBKxWARPS (e.g. 32x512x4)")
    args = ap.parse_args()
    tiles = SWEEP if args.tiles is None else [tuple(int(v) for v in t.split("x")) for t in args.tiles]
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for name in args.shapes:
            k, n = SHAPES[name]
            row = bench(name, k, n, dtype, args.sweep and dtype == torch.bfloat16, args.splits, tiles)
            rows.append(row)
            print(
                f"{name:<14} {row['dtype']:<9} cuBLAS {row['cublas_us']:6.1f} us  paired {row['paired_us']:6.1f} us "
                f"({row['speedup']:.2f}x, {row['TBps']:.2f} TB/s)  err {row['err']:.1e} (cuBLAS "
                f"{row['err_cublas']:.1e})  PTX == emulation: {row['ptx_equals_emulation']}  [{row['default']}]",
                flush=True,
            )
            if "best" in row:
                top = sorted((v, key) for key, v in row["sweep_us"].items() if isinstance(v, float))[:6]
                print("   fastest: " + ", ".join(f"{key} {v:.1f}" for v, key in top), flush=True)
    write_results(args.out, "nvfp4_paired.json", rows)


if __name__ == "__main__":
    main()
