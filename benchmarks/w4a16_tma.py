"""The paired W4A16 GEMV fed by pipelined TMA loads (``w4a16_tma_kernel.py``: the words through shared memory,
several K tiles in flight without registers) against the register-loaded ``matmul_paired`` and cuBLAS, one bf16
row, group 128, SALA shapes, on a Hopper GPU: 7 tile / stage launches at 4 split counts each (the TMA kernel
without the range read ``matmul_paired`` makes for bf16, which costs that one 0.2-0.3 us).

  python benchmarks/w4a16_tma.py --out OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results
from salaquant.kernels.w4a16 import triton_kernels as tk
from triton.tools.tensor_descriptor import TensorDescriptor
from w4a16_tma_kernel import paired_tma_kernel

SWEEP = [  # (block_n, block_k, warps, pipeline stages)
    (256, 64, 4, 2),
    (256, 64, 4, 3),
    (256, 64, 4, 4),
    (256, 64, 4, 6),
    (256, 128, 4, 3),
    (512, 64, 4, 3),
    (512, 32, 4, 6),
]


def tma_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bn: int, bk: int, warps: int, stages: int, split
) -> torch.Tensor:
    """``x [1, K] @ W^T`` by ``paired_tma_kernel`` (GPTQ group 128, split-K as ``matmul_paired``; ``x`` within fp16's
    range)."""
    k, n = x.shape[1], qweight.shape[1]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid, part, cnt = tk._fixed_split_k(x, 1, n, k, bn, bk, split, tk._PAIRED_MIN_TILES)
    desc = TensorDescriptor.from_tensor(qweight, [bk // 8, bn])
    meta = {"GROUP_SIZE": GROUP, "BLOCK_N": bn, "BLOCK_K": bk, "BF16": x.dtype == torch.bfloat16, "ASM": True}
    paired_tma_kernel[grid](
        x, desc, scales, y, part, cnt, n, k, **meta, STAGES=stages, num_warps=warps, num_stages=stages
    )
    return y


def bench(name: str, k: int, n: int, rep: int, splits: list[int | None]) -> dict:
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    qw = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
    sc = [(torch.rand(k // GROUP, n, device="cuda") * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qw[i], sc[i], 4, GROUP, dtype=torch.bfloat16).contiguous() for i in range(COPIES)]
    ref = tk.matmul_paired(x, qw[0], sc[0], 4, GROUP).float()
    row: dict = {"layer": name, "cublas_us": _time_us(lambda i: F.linear(x, dense[i]), rep)}
    row["paired_us"] = _time_us(lambda i: tk.matmul_paired(x, qw[i], sc[i], 4, GROUP), rep)
    print(f"{name}: cuBLAS {row['cublas_us']:.1f}  paired {row['paired_us']:.1f}", flush=True)
    for bn, bk, warps, stages in SWEEP:
        for split in splits:
            label = f"bn{bn}_bk{bk}_w{warps}_st{stages}_s{split}"
            launch = (bn, bk, warps, stages, split)
            try:
                y = tma_matmul(x, qw[0], sc[0], *launch).float()
                us = _time_us(lambda i, launch=launch: tma_matmul(x, qw[i], sc[i], *launch), rep // 2)
            except Exception as exc:  # a failing launch is reported, the rest still run
                row[label] = f"failed: {type(exc).__name__}: {exc}"[:300]
                print(label, row[label], flush=True)
                continue
            err = float((y - ref).abs().max() / ref.abs().max())
            row[label] = {"us": us, "max_rel_diff_to_paired": err}
            print(f"  {label:<32} {us:6.1f} us  {row['cublas_us'] / us:.2f}x  diff {err:.1e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--splits", nargs="*", default=["default", "8", "16", "32"])
    args = ap.parse_args()
    splits = [None if v == "default" else int(v) for v in args.splits]
    rows = [bench(name, *SHAPES[name], args.rep, splits) for name in args.shapes]
    write_results(args.out, "w4a16_tma.json", rows)


if __name__ == "__main__":
    main()
