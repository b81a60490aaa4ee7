"""Launch-configuration sweep of the W4A16 split-K kernels at SALA shapes (M = 1 and 16) on a GPU.

Every configuration of ``matmul_flat`` (CUDA-core reduction for M = 1, ``tl.dot`` with and without in-register
word expansion for M = 1 and 16) and of ``matmul_wleft`` (tile width, splits, warps, stages) is checked against
the dequantize-then-matmul result and timed in a CUDA graph over 4 rotated weight copies, beside cuBLAS bf16
``F.linear`` and the current default path timed the same way.
The table lists the fastest configurations per shape; the JSON holds all of them. This is what the default
configuration table in ``triton_kernels`` is chosen from.

  python benchmarks/w4a16_sweep.py --out OUT [--shapes gate_up down] [--m 1 16] [--kinds wleft] [--wide]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from results import write_results
from salaquant.kernels.w4a16 import triton_kernels as tk

SHAPES = {"gate_up": (4096, 32768), "down": (16384, 4096), "lightning_qkv": (4096, 12288), "o_proj": (4096, 4096)}
COPIES = 4
GROUP = 128
CONFIG_KEYS = (
    "kernel",
    "block_n",
    "block_k",
    "tiles",
    "split_k",
    "num_warps",
    "num_stages",
    "ahead",
    "cuda_cores",
    "expand",
)


def graph_us(fn: Callable[[int], object]) -> float:
    """Median time per call of ``fn(copy)`` replayed in a CUDA graph that runs every copy once."""

    def all_copies() -> None:
        for i in range(COPIES):
            fn(i)

    all_copies()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(all_copies, rep=50, return_mode="median") * 1e3 / COPIES


def eager_us(fn: Callable[[int], object]) -> float:
    counter = itertools.count()
    return triton.testing.do_bench(lambda: fn(next(counter) % COPIES), rep=50, return_mode="median") * 1e3


def candidates(m: int, kinds: tuple[str, ...] = ("gemv", "flat", "wleft"), wide: bool = False) -> list[dict]:
    """Configurations of the kinds asked for: ``gemv`` (CUDA-core reduction, M = 1), ``flat`` (``tl.dot`` on
    the activation side) and ``wleft`` (the weights as the MMA's left operand, ``split_k`` None = the default,
    ``ahead`` tiles of words loaded ahead of the math, the default single pipeline stage; ``wide`` adds 256-column
    tiles, 64-row K tiles and 2 or 3 pipeline stages)."""
    out = []
    if m == 1 and "gemv" in kinds:
        for bn, bk, t, w in itertools.product((64, 128, 256), (64, 128), (1, 2, 4), (2, 4)):
            out.append(dict(block_n=bn, block_k=bk, tiles=t, num_warps=w, cuda_cores=True, expand=False))
    for bn, bk, t, ex in itertools.product((64, 128, 256), (64, 128), (1, 2), (False, True)):
        if "flat" in kinds:
            out.append(dict(block_n=bn, block_k=bk, tiles=t, num_warps=4, cuda_cores=False, expand=ex))
    if "wleft" in kinds:
        for bn, split, w, ahead in itertools.product((32, 64, 128), (None, 1, 2, 4), (4, 8), (1, 2)):
            out.append(dict(kernel="wleft", block_n=bn, split_k=split, num_warps=w, ahead=ahead))
        if wide:
            for bn, bk, split, w, ahead, stages in itertools.product(
                (64, 128, 256), (64, 128), (None, 1, 2), (4, 8), (1, 2), (1, 2, 3)
            ):
                if (bn, bk, stages) == (256, 128, 1) or (bn != 256 and bk == 128 and stages == 1):
                    continue  # 128-row tiles of up to 128 columns in one stage are the list above
                out.append(
                    dict(
                        kernel="wleft",
                        block_n=bn,
                        block_k=bk,
                        split_k=split,
                        num_warps=w,
                        ahead=ahead,
                        num_stages=stages,
                    )
                )
    return out


def _run(cfg: dict) -> Callable[..., torch.Tensor]:
    """The kernel a configuration names, with the configuration's launch settings bound."""
    options = {key: val for key, val in cfg.items() if key != "kernel"}
    kernel = tk.matmul_wleft if cfg.get("kernel") == "wleft" else tk.matmul_flat
    return lambda x, w, s: kernel(x, w, s, 4, GROUP, **options)


def sweep_case(
    name: str,
    k: int,
    n: int,
    m: int,
    qw: list,
    sc: list,
    dense: list,
    top: int,
    t0: float,
    kinds: tuple[str, ...],
    wide: bool = False,
) -> dict:
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(x, dense[0]).float()
    base = {
        "cublas": graph_us(lambda i: F.linear(x, dense[i])),
        "cublas_eager": eager_us(lambda i: F.linear(x, dense[i])),
        "default": graph_us(lambda i: tk.matmul(x, qw[i], sc[i], 4, GROUP)),
        "default_eager": eager_us(lambda i: tk.matmul(x, qw[i], sc[i], 4, GROUP)),
    }
    results = []
    for cfg in candidates(m, kinds, wide):
        try:
            run = _run(cfg)
            y = run(x, qw[0], sc[0]).float()
            err = float((y - ref).norm() / ref.norm())
            us = graph_us(lambda i, run=run: run(x, qw[i], sc[i]))
            results.append({**cfg, "us": us, "rel_err": err})
        except Exception as exc:  # a configuration that fails to compile is recorded, the rest still run
            results.append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:300]})
    ok = sorted((r for r in results if "us" in r and r["rel_err"] < 1e-2), key=lambda r: r["us"])
    row = {"layer": name, "K": k, "N": n, "M": m, **base, "configs": results}
    print(
        f"{name:14} M={m:<3} cuBLAS {base['cublas']:7.1f} us (eager {base['cublas_eager']:.1f})  default "
        f"{base['default']:7.1f} us (eager {base['default_eager']:.1f})  [{time.time() - t0:.0f} s]",
        flush=True,
    )
    for r in ok[:top]:
        cfg = " ".join(f"{key}={r[key]}" for key in CONFIG_KEYS if key in r)
        print(f"    {r['us']:7.1f} us  x{base['cublas'] / r['us']:.2f}  {cfg}  err={r['rel_err']:.1e}", flush=True)
    bad = [r for r in results if "us" in r and r["rel_err"] >= 1e-2]
    if bad:
        print(f"    {len(bad)} configurations gave wrong results, e.g. {bad[0]}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=["gemv", "flat", "wleft"], choices=["gemv", "flat", "wleft"])
    ap.add_argument("--wide", action="store_true", help="more wleft tiles, K tiles and pipeline stages")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    t0 = time.time()
    for name in args.shapes:
        k, n = SHAPES[name]
        qw = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
        sc = [(torch.rand(k // GROUP, n, device="cuda") * 0.01 + 1e-3).half() for _ in range(COPIES)]
        dense = [tk.dequantize(qw[i], sc[i], 4, GROUP).contiguous() for i in range(COPIES)]
        for m in args.m:
            rows.append(sweep_case(name, k, n, m, qw, sc, dense, args.top, t0, tuple(args.kinds), args.wide))
    write_results(
        args.out,
        "w4a16_sweep.json",
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows},
        indent=None,
    )


if __name__ == "__main__":
    main()
