"""NVFP4 weight-only GEMM (salaquant.kernels.nvfp4) vs cuBLAS bf16 ``F.linear`` at MiniCPM-SALA shapes.

Times are medians over CUDA-graph replays of one call per weight copy (4 copies, so the weights come from HBM
rather than L2), as a decode step runs in a server, without the Python launch cost; ``*_eager_us`` are medians of
``triton.testing.do_bench`` on single eager calls cycling over the copies. ``speedup`` is cuBLAS time / our time,
both from graphs. ``--sweep`` also times a small set of launch
configurations per case and reports the fastest (use ``--layers`` / ``--ms`` to split a long sweep).

  python benchmarks/kernels_nvfp4.py --out OUT [--sweep] [--layers gate_up,down] [--ms 1,16]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from common import KERNEL_MS, KERNEL_SHAPES, WEIGHT_COPIES, write_results
from triton.testing import do_bench, do_bench_cudagraph

from salaquant.kernels.backend import DEQUANT_MIN_M
from salaquant.kernels.mma_rows import MAX_ROWS
from salaquant.kernels.nvfp4 import nvfp4_matmul, nvfp4_matmul_reference
from salaquant.kernels.nvfp4 import triton_kernels as tk
from salaquant.kernels.nvfp4.tuning import MMA_ROWS_CONFIG, ROWS_MAX_M, _rows_split

DEVICE = "cuda"
DOT_TILES: tuple[tuple[int | None, int, int, int, int, int], ...] = (
    (16, 16, 64, 128, 4, 1),
    (16, 16, 64, 256, 4, 1),
    (16, 16, 128, 128, 4, 1),
    (16, 16, 128, 128, 8, 1),
    (16, 16, 64, 128, 4, 2),
    (16, 16, 64, 128, 4, 3),
    (256, 64, 128, 128, 8, 3),
    (256, 128, 128, 64, 8, 3),
    (256, 128, 64, 128, 4, 3),
    (256, 32, 128, 128, 4, 3),
    (256, 64, 64, 128, 4, 1),
    (256, 64, 128, 64, 8, 3),
    (256, 64, 64, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
    (None, 256, 128, 64, 8, 3),
    (None, 128, 256, 64, 8, 3),
    (None, 128, 128, 128, 8, 3),
    (None, 256, 128, 64, 8, 2),
    (None, 64, 128, 64, 4, 4),
)
"""The tensor-core kernel's tiles ``--sweep`` tries: (band, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). A row is
tried for M in its band: M <= 16 (band 16), 16 < M <= 256 (band 256) or M > 256 (None); the first two with each
of three split-K values around the default's, the last without split-K."""


def _nvfp4_copies(k: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``WEIGHT_COPIES`` random NVFP4 weights (all codes; finite block scales in [0.5, 2]; global scale 0.01)."""
    out = []
    for _ in range(WEIGHT_COPIES):
        weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEVICE)
        scale = (torch.rand(n, k // 16, device=DEVICE) * 1.5 + 0.5).to(torch.float8_e4m3fn)
        out.append((weight, scale, torch.tensor(0.01, device=DEVICE)))
    return out


def _rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """A callable that runs the next of ``fns`` on each call."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _eager_us(fns: list[Callable[[], object]], quick: bool = False) -> float:
    """Median time of one eager call in microseconds, cycling over ``fns`` (one per weight copy)."""
    fn = _rotating(fns)
    if quick:
        return 1e3 * float(do_bench(fn, warmup=10, rep=30, return_mode="median"))
    return 1e3 * float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _time_us(fns: list[Callable[[], object]], quick: bool = False) -> float:
    """Median time of one call in microseconds, from CUDA-graph replays of every call of ``fns`` in turn."""

    def all_copies() -> None:
        for fn in fns:
            fn()

    all_copies()  # compile outside the graph
    torch.cuda.synchronize()
    rep = 30 if quick else 100
    return 1e3 * float(do_bench_cudagraph(all_copies, rep=rep, return_mode="median")) / len(fns)


def _weight_bytes(m: int, k: int, n: int, x_bytes: int = 2) -> int:
    """Bytes an NVFP4 GEMM must move: packed codes, FP8 scales, activations and output."""
    return n * k // 2 + n * k // 16 + m * k * x_bytes + m * n * x_bytes


def _candidates(m: int, k: int, n: int) -> list[tk.NVFP4Config]:
    """Launch configurations tried by ``--sweep`` for one case."""
    base = tk.default_config(m, n, k, DEVICE)
    splits = sorted({max(1, base.split_k // 2), base.split_k, base.split_k * 2})
    cands: list[tk.NVFP4Config] = []
    if m == 1:
        paired = tk.default_config(m, n, k, DEVICE, torch.bfloat16)
        for bn, bk, warps in (
            (128, 128, 4),
            (256, 128, 4),
            (128, 64, 2),
            (64, 256, 2),
            (128, 256, 4),
            (256, 256, 8),
            (64, 512, 4),
            (128, 512, 8),
            (32, 512, 2),
        ):
            cands += [
                tk.NVFP4Config("paired", block_n=bn, block_k=bk, split_k=s, num_warps=warps, num_stages=1)
                for s in sorted({max(1, paired.split_k // 2), paired.split_k, paired.split_k * 2})
            ]
    band = 16 if m <= 16 else 256 if m <= 256 else None
    tile_splits = splits if m <= 256 else [1]
    for top, bm, bn, bk, warps, stages in DOT_TILES:
        if top == band:
            cands += [tk.NVFP4Config("dot", bm, bn, bk, s, num_warps=warps, num_stages=stages) for s in tile_splits]
    return cands


def _bench_case(name: str, k: int, n: int, m: int, sweep: bool) -> dict[str, object]:
    """Time cuBLAS, our auto path, the fused and the dequant path (and the sweep) for one layer and M."""
    copies = _nvfp4_copies(k, n)
    dense = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHT_COPIES)]
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    row: dict[str, object] = {"layer": name, "K": k, "N": n, "M": m}

    cublas = [lambda w=w: F.linear(x, w) for w in dense]
    row["cublas_us"] = _time_us(cublas)
    row["cublas_eager_us"] = _eager_us(cublas)
    del dense

    ref = nvfp4_matmul_reference(x.float(), *copies[0])
    scale = float(ref.abs().max())

    def dequant_linear(c: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.linear(x, tk.nvfp4_dequantize_triton(*c, dtype=x.dtype))

    paths: dict[str, Callable[[tuple], torch.Tensor]] = {
        "triton": lambda c: tk.nvfp4_matmul_triton(x, *c),  # the fused kernels (default config)
        "dequant": dequant_linear,  # the weight dequantized, then cuBLAS
    }

    def run(path: str) -> tuple[float | None, float | None, str | None]:
        try:
            y = paths[path](copies[0])
            err = float((y.float() - ref).abs().max()) / scale
            fns = [lambda c=c: paths[path](c) for c in copies]
            row[f"{path}_eager_us"] = _eager_us(fns)
            return _time_us(fns), err, None
        except Exception as e:  # a failing path is reported, not fatal
            return None, None, f"{type(e).__name__}: {e}"[:300]

    row["auto_path"] = "dequant" if m >= DEQUANT_MIN_M else "triton"  # what nvfp4_matmul takes on CUDA
    row["default_config"] = dataclasses.asdict(tk.default_config(m, n, k, DEVICE, x.dtype))
    if m == 1:  # the tensor-core kernel the paired GEMV replaced for one row
        dot = tk.default_config(m, n, k, DEVICE)
        row["dot_us"] = _time_us([lambda c=c: tk.nvfp4_matmul_triton(x, *c, config=dot) for c in copies])
        y = tk.nvfp4_matmul_triton(x, *copies[0], config=dot)
        row["dot_max_rel_err"] = float((y.float() - ref).abs().max()) / scale
    for path in ("triton", "dequant") if m >= 128 else ("triton",):
        us, err, fail = run(path)
        row[f"{path}_us"], row[f"{path}_max_rel_err"] = us, err
        if fail:
            row[f"{path}_error"] = fail
    y = nvfp4_matmul(x, *copies[0])  # the dispatch takes the path named auto_path
    row["auto_max_rel_err"] = float((y.float() - ref).abs().max()) / scale
    if ROWS_MAX_M < m <= MAX_ROWS:  # the row kernel past the rows the default gives it (its default launch)
        block_n = 16 * MMA_ROWS_CONFIG["tiles"] * MMA_ROWS_CONFIG["num_warps"]
        rows = tk.NVFP4Config(
            "rows", block_n=block_n, split_k=_rows_split(n, k, block_n, x.device),
            num_warps=MMA_ROWS_CONFIG["num_warps"], num_stages=1,
        )  # fmt: skip
        row["rows_us"] = _time_us([lambda c=c: tk.nvfp4_matmul_triton(x, *c, config=rows) for c in copies])
    if m <= 16 and row["auto_path"] == "triton":  # the same launches with programmatic dependent launch
        fns = [lambda c=c: tk.nvfp4_matmul_triton(x, *c, pdl=True) for c in copies]
        row["triton_pdl_us"] = _time_us(fns)
    ours = row.get(f"{row['auto_path']}_us")
    row["ours_us"] = ours
    row["speedup"] = row["cublas_us"] / ours if ours else None
    if m <= 16 and ours:
        row["ours_TBps"] = _weight_bytes(m, k, n) / (ours * 1e-6) / 1e12

    if sweep:
        results = []
        for cfg in _candidates(m, k, n):
            try:
                fns = [lambda c=c, cfg=cfg: tk.nvfp4_matmul_triton(x, *c, config=cfg) for c in copies]
                results.append((_time_us(fns, quick=True), cfg))
            except Exception as e:
                results.append((float("inf"), cfg))
                row.setdefault("sweep_errors", []).append(f"{cfg}: {type(e).__name__}: {e}"[:300])
        best_us, best_cfg = min(results, key=lambda r: r[0])
        row["sweep"] = [{"us": us, **dataclasses.asdict(c)} for us, c in results]
        row["sweep_best_us"] = best_us
        row["sweep_best_config"] = dataclasses.asdict(best_cfg)
        row["sweep_best_speedup"] = row["cublas_us"] / best_us
    torch.cuda.empty_cache()
    return row


def _fmt(v: object, spec: str = ".1f") -> str:
    """``v`` formatted with ``spec``, or ``-``."""
    return "-" if v is None else format(v, spec)


def _print_table(rows: list[dict[str, object]]) -> None:
    """Markdown table of the results."""
    print(
        "| layer (K -> N) | M | cuBLAS bf16 us | ours us | speedup | path | fused us | dequant+cuBLAS us "
        "| max rel err | sweep best us | sweep speedup | sweep best config |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = r.get("sweep_best_config")
        best_s = (
            "-"
            if not best
            else "{kernel} {block_m}x{block_n}x{block_k} s{split_k} w{num_warps} st{num_stages}".format(**best)
        )
        err = r.get(f"{r['auto_path']}_max_rel_err")
        print(
            f"| {r['layer']} ({r['K']} -> {r['N']}) | {r['M']} | {_fmt(r['cublas_us'])} | {_fmt(r['ours_us'])} "
            f"| {_fmt(r['speedup'], '.2f')}x | {r['auto_path']} | {_fmt(r.get('triton_us'))} "
            f"| {_fmt(r.get('dequant_us'))} | {_fmt(err, '.1e')} | {_fmt(r.get('sweep_best_us'))} "
            f"| {_fmt(r.get('sweep_best_speedup'), '.2f')} | {best_s} |"
        )
        for key in ("triton_error", "dequant_error"):
            if key in r:
                print(f"|   {key}: {r[key]} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="JSON file, or a folder for kernels_nvfp4.json")
    ap.add_argument("--sweep", action="store_true", help="also time candidate launch configurations")
    ap.add_argument(
        "--layers", default=",".join(KERNEL_SHAPES), help="comma-separated subset of " + ",".join(KERNEL_SHAPES)
    )
    ap.add_argument("--ms", default=",".join(map(str, KERNEL_MS)), help="comma-separated M values")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.layers.split(","):
        k, n = KERNEL_SHAPES[name]
        for m in (int(v) for v in args.ms.split(",")):
            rows.append(_bench_case(name, k, n, m, args.sweep))
            r, sweep = rows[-1], args.sweep
            print(
                f"{name} M={m}: cuBLAS {_fmt(r['cublas_us'])} us, ours {_fmt(r['ours_us'])} us "
                f"({_fmt(r['speedup'], '.2f')}x)"
                + (f", tensor-core kernel {_fmt(r['dot_us'])} us" if "dot_us" in r else "")
                + (f", sweep best {_fmt(r.get('sweep_best_us'))} us {r.get('sweep_best_config')}" if sweep else ""),
                flush=True,
            )
    _print_table(rows)
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copies": WEIGHT_COPIES,
        "dequant_min_m": DEQUANT_MIN_M,
        "rows": rows,
    }
    write_results(args.out, "kernels_nvfp4.json", res)


if __name__ == "__main__":
    main()
