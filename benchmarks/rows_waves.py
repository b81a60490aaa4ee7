"""Split count and register cap of the few-row kernels against how many programs an H200 holds at once.

A launch whose programs exceed what the SMs hold at once (``SMs x programs per SM``, the latter set by registers
per thread) runs a second, mostly empty wave. For each SALA shape this times, as CUDA-graph medians over 4 weight
copies (``kernels_w4a16.py``'s method), cuBLAS bf16 and:

* ``mma``: ``matmul_mma_rows`` (GPTQ g128, bf16) at each row count, launch ``(tiles, warps)``, split and
  register cap;
* ``paired``: the one-row W4A16 GEMV (``matmul_paired``) at each split and register cap;
* ``nvfp4``: the one-row NVFP4 GEMV (``nvfp4_matmul_triton`` with its default paired config) likewise;
* ``cache``: ``matmul_mma_rows`` at its default launch with the weights' loads kept out of L1 (``.cg``) and/or the
  activations' loads marked ``evict_last``, so the activations, which every program rereads, stay in L1.

  python benchmarks/rows_waves.py --out OUT [--studies mma paired nvfp4 cache] [--shapes gate_up down] [--ms 8 16]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results
from salaquant.kernels.nvfp4 import triton_kernels as nk
from salaquant.kernels.w4a16 import triton_kernels as tk

MMA_LAUNCHES = [(1, 4), (1, 2), (2, 4), (2, 2)]
SPLITS = (None, 1, 2, 3, 4, 6, 8)
MMA_CAPS = (None, 64)
PAIRED_CAPS = (None, 80)
NVFP4_CAPS = (None, 168, 128)
CACHE_LAUNCHES = [("", ""), (".cg", ""), ("", "evict_last"), (".cg", "evict_last")]


def _time_all(run, caps, launches, rep: int, splits=SPLITS) -> dict:
    out = {}
    for cap in caps:
        for launch in launches:
            for split in splits:
                label = f"{launch}_s{split}_r{cap}"
                try:
                    out[label] = _time_us(lambda i, c=cap, la=launch, s=split: run(i, c, la, s), rep)
                except Exception as exc:  # reported; the other settings still run
                    out[label] = f"{type(exc).__name__}: {exc}"[:160]
    return out


def _summary(row: dict) -> str:
    timed = sorted((v, k) for k, v in row["times"].items() if isinstance(v, float))
    default = row["times"].get(row["default"])
    best = f"{timed[0][0]:.1f} us {timed[0][1]}" if timed else "none"
    return f"cuBLAS {row['cublas_us']:.1f} us, default {default} us, best {best}"


def _shape_rows(name: str, studies: list[str], ms: list[int], rep: int, gen: torch.Generator):
    """Yields one result row per study and row count of one shape."""
    k, n = SHAPES[name]
    qw = [
        torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=gen)
        for _ in range(COPIES)
    ]
    sc = [(torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qw[i], sc[i], 4, GROUP, dtype=torch.bfloat16).contiguous() for i in range(COPIES)]
    for study in studies:
        for m in ms if study in ("mma", "cache") else [1]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            row: dict = {"study": study, "layer": name, "K": k, "N": n, "M": m}
            row["cublas_us"] = _time_us(lambda i, x=x: F.linear(x, dense[i]), rep)
            if study == "mma":
                cfg = tk.MMA_ROWS_CONFIG

                def run(i, cap, launch, split, x=x):
                    return tk.matmul_mma_rows(
                        x, qw[i], sc[i], 4, GROUP, tiles=launch[0], num_warps=launch[1], split_k=split, maxnreg=cap
                    )

                row["default"] = f"{(cfg['tiles'], cfg['num_warps'])}_sNone_rNone"
                row["times"] = _time_all(run, MMA_CAPS, MMA_LAUNCHES, rep)
            elif study == "cache":

                def run(i, cap, launch, split, x=x):
                    return tk.matmul_mma_rows(x, qw[i], sc[i], 4, GROUP, weight_cache=launch[0], x_evict=launch[1])

                row["default"] = "('', '')_sNone_rNone"
                row["times"] = _time_all(run, [None], CACHE_LAUNCHES, rep, [None])
            elif study == "paired":

                def run(i, cap, launch, split, x=x):
                    return tk.matmul_paired(x, qw[i], sc[i], 4, GROUP, split_k=split, maxnreg=cap)

                row["default"] = "paired_sNone_rNone"
                row["times"] = _time_all(run, PAIRED_CAPS, ["paired"], rep)
            else:
                w = [
                    torch.randint(0, 256, (n, k // 2), dtype=torch.int32, device="cuda", generator=gen).to(torch.uint8)
                    for _ in range(COPIES)
                ]
                s = torch.randint(0x28, 0x48, (n, k // 16), dtype=torch.int32, device="cuda", generator=gen)
                s8 = s.to(torch.uint8).view(torch.float8_e4m3fn)
                s2 = torch.tensor(0.01, device="cuda")
                base = nk.default_config(1, n, k, x.device, x.dtype)

                def run(i, cap, launch, split, x=x, w=w, s8=s8, s2=s2, base=base):
                    cfg = dataclasses.replace(base, maxnreg=cap, split_k=split or base.split_k)
                    return nk.nvfp4_matmul_triton(x, w[i], s8, s2, config=cfg)

                row["default"] = "paired_sNone_rNone"
                row["default_split"] = base.split_k
                row["times"] = _time_all(run, NVFP4_CAPS, ["paired"], rep)
            yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=40, help="do_bench_cudagraph budget (ms) per timing")
    studies = ["mma", "paired", "nvfp4", "cache"]
    ap.add_argument("--studies", nargs="*", default=studies[:3], choices=studies)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=[8, 16])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    for name in args.shapes:
        for row in _shape_rows(name, args.studies, args.ms, args.rep, gen):
            rows.append(row)
            print(f"{row['study']:<6} {name:<14} M={row['M']:<3} {_summary(row)}", flush=True)
            write_results(args.out, "rows_waves.json", {"device": torch.cuda.get_device_name(), "rows": rows})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
