"""The W4A16 ``mma.sync`` kernel for 1-16 rows (``matmul_mma_rows``) against cuBLAS bf16 and the library's
current path for the same rows (``matmul``: the paired GEMV at one row, the weights-left kernel for 2-16), on a GPU.

For each SALA shape and row count: CUDA-graph medians over 4 weight copies (as ``kernels_w4a16.py`` times them) of
cuBLAS ``F.linear``, ``matmul`` and ``matmul_mma_rows`` at each launch of ``LAUNCHES`` (column tiles per warp,
warps) and split count, with each result's error against the fp32 product of the dequantized weight; the PTX is
also held to its emulation on the same GPU once per shape.

  python benchmarks/w4a16_mma_rows.py --out OUT [--shapes gate_up down] [--ms 1 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results
from salaquant.kernels.w4a16 import triton_kernels as tk

LAUNCHES = [(2, 4), (4, 4), (2, 8), (1, 4), (4, 8)]
"""(column tiles of 16 per warp, warps) launches timed, each at the default split and at 1, 2 and 4 splits."""
SPLITS = (None, 1, 2, 4)


def bench(name: str, k: int, n: int, ms: list[int], rep: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    qweight = [
        torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=gen)
        for _ in range(COPIES)
    ]
    scales = [(torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qweight[i], scales[i], 4, GROUP, dtype=torch.bfloat16).contiguous() for i in range(COPIES)]
    w32 = tk.dequantize(qweight[0], scales[0], 4, GROUP, dtype=torch.float32)
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        exact = x.float() @ w32.t()

        def rel(y: torch.Tensor, exact: torch.Tensor = exact) -> float:
            return float((y.float() - exact).norm() / exact.norm())

        row: dict = {"layer": name, "K": k, "N": n, "M": m}
        row["cublas_us"] = _time_us(lambda i, x=x: F.linear(x, dense[i]), rep)
        row["library_us"] = _time_us(lambda i, x=x: tk.matmul(x, qweight[i], scales[i], 4, GROUP), rep)
        row["library_err"] = rel(tk.matmul(x, qweight[0], scales[0], 4, GROUP))
        ptx = tk.matmul_mma_rows(x, qweight[0], scales[0], 4, GROUP)
        emulated = tk.matmul_mma_rows(x, qweight[0], scales[0], 4, GROUP, emulate=True)
        row["mma_err"] = rel(ptx)
        row["mma_vs_emulation_max_rel"] = float((ptx.float() - emulated.float()).abs().max() / exact.abs().max())
        launches = {}
        for (tiles, warps), split in ((lw, s) for lw in LAUNCHES for s in SPLITS):
            label = f"t{tiles}_w{warps}_s{split}"
            try:

                def run(i: int, x=x, tiles=tiles, warps=warps, split=split) -> torch.Tensor:
                    return tk.matmul_mma_rows(
                        x, qweight[i], scales[i], 4, GROUP, tiles=tiles, num_warps=warps, split_k=split
                    )

                err = rel(run(0))
                launches[label] = {"us": _time_us(run, rep // 2), "rel_err": err}
            except Exception as exc:  # a failing launch is reported, the rest still run
                launches[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        row["mma_launches"] = launches
        timed = sorted((v["us"], lab) for lab, v in launches.items() if "us" in v and v["rel_err"] < 1e-2)
        row["mma_best"] = timed[0][1] if timed else None
        row["mma_best_us"] = timed[0][0] if timed else None
        rows.append(row)
        best = f"{row['mma_best_us']:.1f} us ({row['mma_best']}, {row['cublas_us'] / row['mma_best_us']:.2f}x)"
        print(
            f"{name:<14} M={m:<3} cuBLAS {row['cublas_us']:6.1f} us  library {row['library_us']:6.1f} us "
            f"({row['cublas_us'] / row['library_us']:.2f}x)  mma best {best}  err {row['mma_err']:.1e} "
            f"(library {row['library_err']:.1e}; PTX - emulation {row['mma_vs_emulation_max_rel']:.1e})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph budget (ms) per timing")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    rows = []
    for name in args.shapes:
        k, n = SHAPES[name]
        rows += bench(name, k, n, args.ms, args.rep)
    write_results(args.out, "w4a16_mma_rows.json", {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
