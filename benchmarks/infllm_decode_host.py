"""Host (Python) cost of one eager InfLLM-v2 decode step, on one GPU.

Without a CUDA graph a decode step's kernels are so short that the time to launch them decides the step. This
times ``infllm_v2_attention`` for one query over a ``--seq``-token cache as the runtime calls it
(``backend="auto"``), each public kernel function alone, dense SDPA decode and two trivial Triton kernels (one
argument; 21 arguments and 4 constexprs), as the wall time of ``--calls`` back-to-back eager calls (the GPU is
not the bottleneck: the step's kernels take about 25 us), then profiles the step's Python with cProfile and
keeps the functions that take the most time.

  python benchmarks/infllm_decode_host.py --out OUT.json [--seq 131072]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from results import write_results
from salaquant.kernels import infllm
from salaquant.kernels.infllm import triton_kernels

from salaquant.model import sparse_attention as ref
from salaquant.model.sparse_attention import SparseParams


@triton.jit
def _touch(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@triton.jit
def _touch_many_args(
    x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
):  # fmt: skip
    tl.store(x_ptr, tl.load(x_ptr) + a0 + b9 + C0 + C3)


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or a folder for infllm_decode_host.json)")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev, dt, t, p = "cuda", torch.bfloat16, args.seq, SparseParams()
    k = torch.randn(1, t, 2, 128, device=dev, dtype=dt)
    v = torch.randn(1, t, 2, 128, device=dev, dtype=dt)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    k1 = ref.compress_keys(k, p.kernel_size, p.kernel_stride)
    k2 = ref.compress_keys(k, p.kernel_size2, p.kernel_stride2)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    q_start = t - 1
    scores = triton_kernels.stage1_scores(q, k1, k2, q_start, p)
    idx = triton_kernels.pool_select(scores, q_start, t, p)
    x = torch.zeros(1, device=dev, dtype=torch.int32)

    cases: dict[str, Callable[[], Any]] = {
        "step_auto": lambda: infllm.infllm_v2_attention(q, k, v, p, k1=k1, k2=k2),
        "stage1_scores": lambda: triton_kernels.stage1_scores(q, k1, k2, q_start, p),
        "pool_select": lambda: triton_kernels.pool_select(scores, q_start, t, p),
        "block_sparse_attention": lambda: triton_kernels.block_sparse_attention(q, k, v, idx, q_start, p),
        "dense_sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
        "empty_cuda_tensor": lambda: torch.empty(16, device=dev),
        "triton_one_arg_kernel": lambda: _touch[(1,)](x),
        "triton_20_int_args_4_constexpr_kernel": lambda: _touch_many_args[(1,)](
            x, *range(100, 120), C0=1, C1=2, C2=3, C3=4
        ),
    }
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "seq": t, "calls": args.calls}
    res["per_call_us"] = {name: _per_call_us(fn, args.calls) for name, fn in cases.items()}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        cases["step_auto"]()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    res["cprofile_step_auto_200_calls"] = text.getvalue()
    for name, us in res["per_call_us"].items():
        print(f"{name:<24} {us:8.1f} us per eager call")
    print(res["cprofile_step_auto_200_calls"])
    write_results(args.out, "infllm_decode_host.json", res)


if __name__ == "__main__":
    main()
