"""GPU benchmark of the W4A16 GEMM (int4 g128, bf16 activations) at SALA shapes against cuBLAS bf16 ``F.linear``
and PyTorch's tinygemm (``torch._weight_int4pack_mm``, when the op exists).

Times are medians over CUDA-graph replays of one call per weight copy (4 copies, so the weights come from HBM
rather than L2): this is how a decode step runs in a server, without the Python launch cost. ``*_eager_us`` are
medians of ``triton.testing.do_bench`` on single eager calls, launch cost included. ``ours`` is ``w4a16_matmul``
(the path it picks for M is named); the other Triton paths that apply to M are timed too (``alt``), which is what
``TILED_MAX_M`` and the launch settings are tuned from. ``--tiled-config`` times the tiled kernel at launch
settings outside its autotuned list as well (``tiled_BMxBNxBKwWsS``).

  python benchmarks/kernels_w4a16.py --out OUT   (OUT a folder, or a .json file)
  python benchmarks/kernels_w4a16.py --out OUT --m 64 128 --tiled-config 64,128,64,8,3 32,128,64,4,3
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from common import KERNEL_MS, KERNEL_SHAPES, WEIGHT_COPIES, write_results

from salaquant.kernels.mma_rows import MAX_ROWS
from salaquant.kernels.w4a16 import triton_kernels as tk
from salaquant.kernels.w4a16 import w4a16_matmul
from salaquant.kernels.w4a16.autotune import config
from salaquant.kernels.w4a16.tiled import tiled_kernel

GROUP = 128
DEVICE = "cuda"


def _time_us(fn: Callable[[int], object], rep: int) -> float:
    """Median time of ``fn(copy)`` in microseconds, from CUDA-graph replays of one call per weight copy."""

    def all_copies() -> None:
        for i in range(WEIGHT_COPIES):
            fn(i)

    all_copies()  # compile and autotune outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(all_copies, rep=rep, return_mode="median") * 1e3 / WEIGHT_COPIES


def _eager_us(fn: Callable[[int], object], rep: int) -> float:
    """Median time of one eager ``fn(copy)`` call, ``copy`` cycling over the weight copies."""
    counter = itertools.count()
    return triton.testing.do_bench(lambda: fn(next(counter) % WEIGHT_COPIES), rep=rep, return_mode="median") * 1e3


def _tinygemm(x: torch.Tensor, k: int, n: int) -> Callable[[int], object] | None:
    """tinygemm on random int4 weights with group 128 (bf16 scale and zero), or None without the op."""
    if not hasattr(torch, "_weight_int4pack_mm") or not hasattr(torch, "_convert_weight_to_int4pack"):
        return None
    sz = [torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16, device=x.device) for _ in range(WEIGHT_COPIES)]
    errors = []
    # The op takes uint8 [N, K/2] in recent PyTorch and int32 [N, K/8] in older releases.
    for dtype, cols in ((torch.uint8, k // 2), (torch.int32, k // 8)):
        try:
            raw = [
                torch.randint(0, 256 if dtype == torch.uint8 else 2**31 - 1, (n, cols), dtype=dtype, device=x.device)
            ]
            packed = [torch._convert_weight_to_int4pack(raw[0], 8) for _ in range(WEIGHT_COPIES)]
            torch._weight_int4pack_mm(x, packed[0], GROUP, sz[0])
        except (RuntimeError, TypeError, NotImplementedError) as e:
            errors.append(str(e).splitlines()[0][:160])
            continue
        return lambda i: torch._weight_int4pack_mm(x, packed[i], GROUP, sz[i])
    print(f"tinygemm unavailable for K={k} N={n}: {errors}")
    return None


def _auto_path(m: int, n: int) -> str:
    if m == 1:
        return "paired"
    if m <= tk.MMA_ROWS_MAX_M:
        return "mma_rows"  # 4-bit codes, bf16 rows and groups of 128, as timed here
    return "tiled" if m <= tk.TILED_MAX_M else "dequant+mm"


def tiled_config(spec: str) -> triton.Config:
    """``BLOCK_M,BLOCK_N,BLOCK_K,warps,stages`` (``,noexpand`` for EXPAND=False) as a tiled-kernel launch."""
    parts = spec.split(",")
    bm, bn, bk, warps, stages = (int(v) for v in parts[:5])
    return config(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EXPAND=parts[5:] != ["noexpand"])


def bench_shape(name: str, k: int, n: int, m: int, rep: int, extra: Sequence[triton.Config] = ()) -> dict:
    dev = DEVICE
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    qweight = [
        torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev) for _ in range(WEIGHT_COPIES)
    ]
    scales = [(torch.rand(k // GROUP, n, device=dev) * 0.01 + 1e-3).half() for _ in range(WEIGHT_COPIES)]
    dense = [
        tk.dequantize(qweight[i], scales[i], 4, GROUP, dtype=torch.bfloat16).contiguous() for i in range(WEIGHT_COPIES)
    ]

    ours = w4a16_matmul(x, qweight[0], scales[0], 4, GROUP)
    expect = F.linear(x, dense[0]).float()
    rel_err = float((ours.float() - expect).norm() / expect.norm())

    row: dict = {"layer": name, "K": k, "N": n, "M": m, "path": _auto_path(m, n), "rel_err_vs_dense": rel_err}
    row["cublas_us"] = _time_us(lambda i: F.linear(x, dense[i]), rep)
    row["ours_us"] = _time_us(lambda i: w4a16_matmul(x, qweight[i], scales[i], 4, GROUP), rep)
    row["cublas_eager_us"] = _eager_us(lambda i: F.linear(x, dense[i]), rep)
    row["ours_eager_us"] = _eager_us(lambda i: w4a16_matmul(x, qweight[i], scales[i], 4, GROUP), rep)
    tiny = _tinygemm(x, k, n)
    row["tinygemm_us"] = _time_us(tiny, rep) if tiny is not None else None

    alt: dict[str, float] = {}
    if m == 1:  # the default path with programmatic dependent launch (pdl=True: each call overlaps the last)
        alt["paired_pdl"] = _time_us(lambda i: tk.matmul_paired(x, qweight[i], scales[i], 4, GROUP, pdl=True), rep)
    elif m <= 16:
        alt["mma_rows_pdl"] = _time_us(lambda i: tk.matmul_mma_rows(x, qweight[i], scales[i], 4, GROUP, pdl=True), rep)
    if m == 1:  # the fp32 GEMV, which 8-bit codes and fp32 activations take
        alt["gemv"] = _time_us(lambda i: tk.matmul_gemv(x, qweight[i], scales[i], 4, GROUP), rep)
    if 1 < m <= 16:  # the flat kernel, which 8-bit codes and fp32 activations take
        alt["flat"] = _time_us(lambda i: tk.matmul_flat(x, qweight[i], scales[i], 4, GROUP), rep)
    if 16 < m <= MAX_ROWS:  # the row kernel past 16 rows (4 or 8 row groups) at three launches
        for tiles, warps in ((1, 4), (2, 4), (1, 8)):
            alt[f"mma_rows_t{tiles}w{warps}"] = _time_us(
                lambda i, t=tiles, w=warps: tk.matmul_mma_rows(
                    x, qweight[i], scales[i], 4, GROUP, tiles=t, num_warps=w
                ),
                rep,
            )
    if m > 16:
        alt["tiled"] = _time_us(lambda i: tk.matmul_tiled(x, qweight[i], scales[i], 4, GROUP), rep)
        best = getattr(tiled_kernel, "best_config", None)  # the autotuner's choice for this M bucket, N and K
        row["tiled_autotuned"] = None if best is None else str(best)
        alt["tiled_unsplit"] = _time_us(lambda i: tk.matmul_tiled(x, qweight[i], scales[i], 4, GROUP, split_k=1), rep)
        for c in extra:
            kw = c.kwargs
            label = f"tiled_{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}w{c.num_warps}s{c.num_stages}"
            label += "" if kw["EXPAND"] else "n"
            alt[label] = _time_us(lambda i, c=c: tk.matmul_tiled(x, qweight[i], scales[i], 4, GROUP, config=c), rep)

        def dequant_mm(i: int) -> torch.Tensor:
            return x @ tk.dequantize(qweight[i], scales[i], 4, GROUP, dtype=torch.bfloat16).t()

        alt["dequant+mm"] = _time_us(dequant_mm, rep)
    alt.pop(row["path"], None)
    row["alt_us"] = alt

    weight_bytes = k * n // 2 + (k // GROUP) * n * 2
    row["speedup_vs_cublas"] = row["cublas_us"] / row["ours_us"]
    row["speedup_vs_tinygemm"] = row["tinygemm_us"] / row["ours_us"] if row["tinygemm_us"] else None
    row["weight_TBps"] = weight_bytes / row["ours_us"] / 1e6
    row["TFLOPs"] = 2 * m * k * n / row["ours_us"] / 1e6
    return row


def _fmt(v: float | None, width: int, digits: int) -> str:
    return ("-" if v is None else f"{v:.{digits}f}").rjust(width)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, required=True, help="folder (kernels_w4a16.json is written there) or .json file"
    )
    ap.add_argument("--shapes", nargs="+", default=list(KERNEL_SHAPES), choices=list(KERNEL_SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=list(KERNEL_MS))
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    ap.add_argument(
        "--tiled-config",
        nargs="*",
        default=[],
        help="tiled-kernel launches to time beside the autotuned one: BLOCK_M,BLOCK_N,BLOCK_K,warps,stages[,noexpand]",
    )
    args = ap.parse_args()

    torch.manual_seed(0)
    rows = []
    head = (
        f"{'layer':14} {'M':>5} {'path':>10} {'cuBLAS us':>10} {'tinygemm':>9} {'ours us':>9} {'x cuBLAS':>8} "
        f"{'x tiny':>7} {'TB/s w':>7} {'TFLOP/s':>8} {'eager cuBLAS/ours':>18}  alt paths (us)"
    )
    print(head)
    print("-" * len(head))
    for name in args.shapes:
        k, n = KERNEL_SHAPES[name]
        for m in args.m:
            r = bench_shape(name, k, n, m, args.rep, [tiled_config(s) for s in args.tiled_config])
            rows.append(r)
            alt = " ".join(f"{p}={t:.1f}" for p, t in r["alt_us"].items())
            print(
                f"{name:14} {m:>5} {r['path']:>10} {r['cublas_us']:>10.1f} {_fmt(r['tinygemm_us'], 9, 1)} "
                f"{r['ours_us']:>9.1f} {r['speedup_vs_cublas']:>8.2f} {_fmt(r['speedup_vs_tinygemm'], 7, 2)} "
                f"{r['weight_TBps']:>7.2f} {r['TFLOPs']:>8.1f} "
                f"{r['cublas_eager_us']:>8.1f}/{r['ours_eager_us']:<9.1f}  {alt}",
                flush=True,
            )
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "group_size": GROUP,
        "weight_copies": WEIGHT_COPIES,
        "tiled_max_m": tk.TILED_MAX_M,
        "rows": rows,
    }
    write_results(args.out, "kernels_w4a16.json", res)


if __name__ == "__main__":
    main()
