"""The few-row matrix kernels launched once per case, for Nsight Compute to read their hardware counters.

Runs ``matmul`` (W4A16 g128, bf16 activations) and ``nvfp4_matmul_triton`` at the SALA shapes for each row count,
one warm-up launch and one measured launch per case, each case between NVTX ranges named ``FORMAT/SHAPE/M`` so a
profile can be filtered by them. On its own it only runs the kernels; the counters come from ``ncu``:

  ncu --clock-control none --nvtx --print-nvtx-rename kernel --section SpeedOfLight --section MemoryWorkloadAnalysis \\
      --section Occupancy --section WarpStateStats --csv --page details \\
      python benchmarks/ncu_rows.py --shapes gate_up down --ms 1 8 16 > OUT/ncu.csv
"""

from __future__ import annotations

import argparse

import torch
from kernels_w4a16 import GROUP, SHAPES
from salaquant.kernels.nvfp4 import triton_kernels as nk
from salaquant.kernels.w4a16 import triton_kernels as tk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["gate_up", "down"], choices=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 8, 16])
    ap.add_argument("--formats", nargs="*", default=["gptq"], choices=["gptq", "nvfp4"])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for fmt in args.formats:
        for name in args.shapes:
            k, n = SHAPES[name]
            if fmt == "gptq":
                qw = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=gen)
                sc = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.01 + 1e-3).half()

                def run(x: torch.Tensor, qw: torch.Tensor = qw, sc: torch.Tensor = sc) -> torch.Tensor:
                    return tk.matmul(x, qw, sc, 4, GROUP)
            else:
                w = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, device="cuda", generator=gen).to(torch.uint8)
                s = torch.randint(0x28, 0x48, (n, k // 16), dtype=torch.int32, device="cuda", generator=gen)
                s8 = s.to(torch.uint8).view(torch.float8_e4m3fn)
                s2 = torch.tensor(0.01, device="cuda")

                def run(
                    x: torch.Tensor, w: torch.Tensor = w, s8: torch.Tensor = s8, s2: torch.Tensor = s2
                ) -> torch.Tensor:
                    return nk.nvfp4_matmul_triton(x, w, s8, s2)

            for m in args.ms:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
                run(x)  # compile outside the measured range
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"{fmt}/{name}/{m}")
                run(x)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
