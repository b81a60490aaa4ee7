"""The paired-fp16 W4A16 GEMV against the fp32 GEMV and cuBLAS bf16 ``F.linear`` at one activation row, on a GPU.

For each SALA shape: CUDA-graph medians (4 weight copies, as ``kernels_w4a16.py`` times them) of ``matmul_gemv``,
``matmul_paired`` (its default launch; with ``--sweep`` also every launch in ``SWEEP`` at several split counts) and
cuBLAS; the errors of both GEMVs against the fp32 product of the dequantized weight, and the PTX path against its
emulation on the same GPU.

  python benchmarks/w4a16_paired.py --out OUT   (OUT a folder, or a .json file)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results
from salaquant.kernels.w4a16 import triton_kernels as tk

SWEEP = [
    (256, 64, 4, 0, None),
    (512, 64, 4, 0, None),
    (256, 64, 2, 0, None),
    (256, 128, 4, 0, None),
    (512, 64, 8, 0, None),
    (256, 32, 4, 0, None),
    (256, 64, 4, 0, 72),
    (256, 64, 4, 0, 64),
    (256, 64, 4, 64, None),
    (256, 64, 4, 64, 72),
    (256, 64, 4, 64, 64),
    (256, 64, 4, 32, None),
    (512, 64, 4, 128, None),
    (256, 64, 8, 32, None),
    (512, 64, 8, 64, None),
    (128, 64, 4, 32, None),
]
"""(BLOCK_N, BLOCK_K, warps, sub-tile, register cap) launches ``--sweep`` times, each at several split counts."""


def bench(name: str, k: int, n: int, dtype: torch.dtype, rep: int, sweep: bool, splits: list[int | None]) -> dict:
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    qweight = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
    scales = [(torch.rand(k // GROUP, n, device="cuda") * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qweight[i], scales[i], 4, GROUP, dtype=dtype).contiguous() for i in range(COPIES)]
    exact = x.float() @ tk.dequantize(qweight[0], scales[0], 4, GROUP, dtype=torch.float32).t()

    def rel(y: torch.Tensor) -> float:
        return float((y.float() - exact).norm() / exact.norm())

    paired = tk.matmul_paired(x, qweight[0], scales[0], 4, GROUP)
    emulated = tk.matmul_paired(x, qweight[0], scales[0], 4, GROUP, emulate=True)
    row: dict = {
        "layer": name,
        "K": k,
        "N": n,
        "dtype": str(dtype).removeprefix("torch."),
        "rel_err_gemv": rel(tk.matmul_gemv(x, qweight[0], scales[0], 4, GROUP)),
        "rel_err_paired": rel(paired),
        "rel_err_cublas": rel(F.linear(x, dense[0])),
        "paired_vs_emulation_max_abs": float((paired.float() - emulated.float()).abs().max()),
        "paired_vs_emulation_max_rel": float(
            (paired.float() - emulated.float()).abs().max() / emulated.float().abs().max()
        ),
    }
    row["cublas_us"] = _time_us(lambda i: F.linear(x, dense[i]), rep)
    row["gemv_us"] = _time_us(lambda i: tk.matmul_gemv(x, qweight[i], scales[i], 4, GROUP), rep)
    row["paired_us"] = _time_us(lambda i: tk.matmul_paired(x, qweight[i], scales[i], 4, GROUP), rep)
    if sweep:
        configs = {}
        for bn, bk, warps, sub, maxnreg in SWEEP:
            label = f"bn{bn}_bk{bk}_w{warps}" + (f"_sub{sub}" if sub else "") + (f"_r{maxnreg}" if maxnreg else "")
            for split in splits:
                try:
                    us = _time_us(
                        lambda i, bn=bn, bk=bk, warps=warps, sub=sub, maxnreg=maxnreg, split=split: tk.matmul_paired(
                            x,
                            qweight[i],
                            scales[i],
                            4,
                            GROUP,
                            split_k=split,
                            block_n=bn,
                            block_k=bk,
                            num_warps=warps,
                            sub=sub,
                            maxnreg=maxnreg,
                        ),
                        rep // 2,
                    )
                except Exception as exc:  # a failing launch is reported, the rest still run
                    configs[f"{label}_s{split}"] = f"failed: {type(exc).__name__}: {exc}"[:200]
                    continue
                configs[f"{label}_s{split}"] = us
        row["paired_sweep_us"] = configs
    weight_bytes = k * n // 2 + (k // GROUP) * n * 2
    row["paired_TBps"] = weight_bytes / row["paired_us"] / 1e6
    row["gemv_TBps"] = weight_bytes / row["gemv_us"] / 1e6
    row["paired_vs_cublas"] = row["cublas_us"] / row["paired_us"]
    row["gemv_vs_cublas"] = row["cublas_us"] / row["gemv_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=200, help="do_bench_cudagraph budget (ms) per timing")
    ap.add_argument("--sweep", action="store_true", help="also time every launch configuration and split")
    ap.add_argument("--splits", nargs="*", default=["default", "8", "16", "32"], help="split counts the sweep tries")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    args = ap.parse_args()
    splits = [None if v == "default" else int(v) for v in args.splits]
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for name in args.shapes:
            k, n = SHAPES[name]
            row = bench(name, k, n, dtype, args.rep, args.sweep and dtype == torch.bfloat16, splits)
            rows.append(row)
            print(
                f"{name:<14} {row['dtype']:<9} cuBLAS {row['cublas_us']:7.1f} us  gemv {row['gemv_us']:6.1f} us "
                f"({row['gemv_vs_cublas']:.2f}x)  paired {row['paired_us']:6.1f} us ({row['paired_vs_cublas']:.2f}x, "
                f"{row['paired_TBps']:.2f} TB/s)  err gemv {row['rel_err_gemv']:.2e} "
                f"paired {row['rel_err_paired']:.2e} "
                f"cuBLAS {row['rel_err_cublas']:.2e}  PTX-emulation {row['paired_vs_emulation_max_rel']:.1e}",
                flush=True,
            )
            if "paired_sweep_us" in row:
                ranked = sorted((v, c) for c, v in row["paired_sweep_us"].items() if isinstance(v, float))
                print("   best launches: " + ", ".join(f"{c} {v:.1f}" for v, c in ranked[:8]), flush=True)
    write_results(args.out, "w4a16_paired.json", {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
