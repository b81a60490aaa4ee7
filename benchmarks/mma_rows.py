"""The 4-bit ``mma.sync`` kernel for 1-16 rows (``salaquant/kernels/mma_rows.py``) against cuBLAS bf16 and the library's
current path for the same rows, on a GPU, for GPTQ W4A16 (``matmul_mma_rows`` against ``matmul``: the paired GEMV
at one row, the weights-left kernel for 2-16) and NVFP4 (``nvfp4_mma_rows`` against ``nvfp4_matmul_triton``).

For each format, SALA shape and row count: CUDA-graph medians over 4 weight copies (as ``kernels_w4a16.py`` times
them) of cuBLAS ``F.linear``, the current path and the mma kernel at each launch of ``LAUNCHES`` (column tiles per
warp, warps) and split count, with each result's error against the fp32 product of the dequantized weight; the PTX
is also held to its emulation on the same GPU once per case.

  python benchmarks/mma_rows.py --out OUT [--formats gptq nvfp4] [--shapes gate_up down] [--ms 1 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results

from salaquant.kernels.nvfp4 import triton_kernels as nk
from salaquant.kernels.w4a16 import triton_kernels as tk

LAUNCHES = [(2, 4), (4, 4), (2, 8), (1, 4), (4, 8)]
"""(column tiles of 16 per warp, warps) launches timed, each at the default split and at 1, 2 and 4 splits."""
SPLITS = (None, 1, 2, 4)


def _gptq(k: int, n: int, gen: torch.Generator):
    """Weight copies, the dense bf16 copies, the fp32 weight, and (library, mma) callables ``f(x, copy, **opts)``."""
    qw = [
        torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=gen)
        for _ in range(COPIES)
    ]
    sc = [(torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qw[i], sc[i], 4, GROUP, dtype=torch.bfloat16).contiguous() for i in range(COPIES)]
    w32 = tk.dequantize(qw[0], sc[0], 4, GROUP, dtype=torch.float32)

    def library(x: torch.Tensor, i: int) -> torch.Tensor:
        return tk.matmul(x, qw[i], sc[i], 4, GROUP)

    def mma(x: torch.Tensor, i: int, **opts) -> torch.Tensor:
        return tk.matmul_mma_rows(x, qw[i], sc[i], 4, GROUP, **opts)

    return dense, w32, library, mma


def _nvfp4(k: int, n: int, gen: torch.Generator):
    def codes() -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, device="cuda", generator=gen).to(torch.uint8)
        s = torch.randint(0x28, 0x48, (n, k // 16), dtype=torch.int32, device="cuda", generator=gen).to(torch.uint8)
        return w, s.view(torch.float8_e4m3fn)

    ws = [codes() for _ in range(COPIES)]
    s2 = torch.tensor(0.01, device="cuda")
    dense = [nk.nvfp4_dequantize_triton(w, s, s2, torch.bfloat16) for w, s in ws]
    w32 = nk.nvfp4_dequantize_triton(ws[0][0], ws[0][1], s2, torch.float32)

    def library(x: torch.Tensor, i: int) -> torch.Tensor:
        return nk.nvfp4_matmul_triton(x, ws[i][0], ws[i][1], s2)

    def mma(x: torch.Tensor, i: int, **opts) -> torch.Tensor:
        return nk.nvfp4_mma_rows(x, ws[i][0], ws[i][1], s2, **opts)

    return dense, w32, library, mma


def bench(
    fmt: str,
    name: str,
    k: int,
    n: int,
    ms: list[int],
    rep: int,
    launches_: list[tuple[int, int]] = LAUNCHES,
    splits: tuple[int | None, ...] = SPLITS,
) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense, w32, library, mma = (_gptq if fmt == "gptq" else _nvfp4)(k, n, gen)
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        exact = x.float() @ w32.t()

        def rel(y: torch.Tensor, exact: torch.Tensor = exact) -> float:
            return float((y.float() - exact).norm() / exact.norm())

        row: dict = {"format": fmt, "layer": name, "K": k, "N": n, "M": m}
        row["cublas_us"] = _time_us(lambda i, x=x: F.linear(x, dense[i]), rep)
        row["library_us"] = _time_us(lambda i, x=x: library(x, i), rep)
        row["library_err"] = rel(library(x, 0))
        ptx, emulated = mma(x, 0), mma(x, 0, emulate=True)
        row["mma_err"] = rel(ptx)
        row["mma_vs_emulation_max_rel"] = float((ptx.float() - emulated.float()).abs().max() / exact.abs().max())
        launches = {}
        for (tiles, warps), split in ((lw, s) for lw in launches_ for s in splits):
            label = f"t{tiles}_w{warps}_s{split}"
            run: Callable[[int], torch.Tensor] = lambda i, x=x, t=tiles, w=warps, s=split: mma(  # noqa: E731
                x, i, tiles=t, num_warps=w, split_k=s
            )
            try:
                err = rel(run(0))
                launches[label] = {"us": _time_us(run, rep // 2), "rel_err": err}
            except Exception as exc:  # a failing launch is reported, the rest still run
                launches[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        row["mma_launches"] = launches
        timed = sorted((v["us"], lab) for lab, v in launches.items() if "us" in v and v["rel_err"] < 1e-2)
        row["mma_best"], row["mma_best_us"] = (timed[0][1], timed[0][0]) if timed else (None, None)
        rows.append(row)
        best = (
            f"{row['mma_best_us']:.1f} us ({row['mma_best']}, {row['cublas_us'] / row['mma_best_us']:.2f}x)"
            if timed
            else "none"
        )
        print(
            f"{fmt:<5} {name:<14} M={m:<3} cuBLAS {row['cublas_us']:6.1f} us  library {row['library_us']:6.1f} us "
            f"({row['cublas_us'] / row['library_us']:.2f}x)  mma best {best}  err {row['mma_err']:.1e} "
            f"(library {row['library_err']:.1e}; PTX - emulation {row['mma_vs_emulation_max_rel']:.1e})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph budget (ms) per timing")
    ap.add_argument("--formats", nargs="*", default=["gptq", "nvfp4"], choices=["gptq", "nvfp4"])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--launches", nargs="*", default=None, help="only these, as TILESxWARPS (default: LAUNCHES)")
    ap.add_argument("--splits", nargs="*", default=None, help="split counts, 'default' for the heuristic's")
    args = ap.parse_args()
    launches = LAUNCHES if args.launches is None else [tuple(int(v) for v in t.split("x")) for t in args.launches]
    splits = SPLITS if args.splits is None else tuple(None if v == "default" else int(v) for v in args.splits)
    rows = []
    for fmt in args.formats:
        for name in args.shapes:
            k, n = SHAPES[name]
            rows += bench(fmt, name, k, n, args.ms, args.rep, launches, splits)
            # written after every shape, so a run cut short still returns what it measured
            write_results(args.out, "mma_rows.json", {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
