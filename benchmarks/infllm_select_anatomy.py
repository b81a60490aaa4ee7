"""Where the time of one decode row's block selection goes, on one GPU.

The selection kernel of ``salaquant.kernels.infllm`` (pool 8,191 stage-1 scores into 2,048 blocks, force the
init and local blocks, find the k-th largest pooled score, write the chosen blocks in order) is rebuilt here
with parts switched off: the counting steps of the search (0, 8, 16 or 32 one-bit steps, or 8, 16 or 21 steps
of a ternary search that makes two counts per sum; no early end, and 32 one-bit steps that end once a count
lands on k, as the library's search does, with the steps taken), the max-pooling gather (five strided loads; one
load per block; or the four windows of a block as one coalesced tile plus the window before), and the final
ordered write (two cumulative sums; or a plain masked store); and radix selects of 4, 8 or 11 bits per pass
(a histogram of the digit, a reverse cumulative sum and one reduction per pass; each must choose the blocks the
32-step bit search chooses, checked before timing). Each variant is launched 20 times inside one CUDA
graph; the time per launch (graph replay / 20) and the kernel's own duration from the profiler are printed, so
the cost of each part is the difference between two variants.

  python benchmarks/infllm_select_anatomy.py --out OUT.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from results import write_results
from salaquant.kernels.infllm.select import radix_kth
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench


@triton.jit
def _select_variant(
    scores_ptr,
    idx_ptr,
    n1,
    n_blocks,
    k_sel,
    pos,
    STEPS: tl.constexpr,
    TERNARY: tl.constexpr,
    EARLY_END: tl.constexpr,
    GATHER: tl.constexpr,
    ORDERED_WRITE: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    RADIX: tl.constexpr = 0,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCK_NB)
    in_range = blocks < n_blocks
    pooled = tl.full([BLOCK_NB], float("-inf"), dtype=tl.float32)
    if GATHER == 1:  # five strided loads, windows 4b - 1 + j (the library's)
        for j in tl.static_range(5):
            w = blocks * 4 - 1 + j
            ok = in_range & (w >= 0) & (w < n1)
            pooled = tl.maximum(pooled, tl.load(scores_ptr + row * n1 + w, mask=ok, other=float("-inf")))
    elif GATHER == 2:  # windows 4b .. 4b + 3 as one [blocks, 4] tile (coalesced), then window 4b - 1
        w4 = blocks[:, None] * 4 + tl.arange(0, 4)[None, :]
        tile = tl.load(scores_ptr + row * n1 + w4, mask=in_range[:, None] & (w4 < n1), other=float("-inf"))
        w = blocks * 4 - 1
        prev = tl.load(scores_ptr + row * n1 + w, mask=in_range & (w >= 0) & (w < n1), other=float("-inf"))
        pooled = tl.maximum(tl.max(tile, 1), prev)
    else:
        pooled = tl.load(scores_ptr + row * n1 + blocks, mask=in_range, other=float("-inf"))
    qb = pos // 64
    forced = (blocks < 1) | ((blocks >= qb - 32) & (blocks <= qb))
    pooled = tl.where(forced, float("inf"), pooled)
    bits = pooled.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(in_range, ordered, -2147483648)
    if RADIX > 0:  # radix select: RADIX bits of the k-th largest image per pass, from one histogram each
        v = radix_kth(ordered, in_range, k_sel, RADIX)
    elif TERNARY:  # two counts per sum (16-bit fields of one int32), the interval cut in thirds
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        for _ in tl.static_range(STEPS):
            third = tl.maximum((hi - lo) // 3, 1)
            c1 = lo + third
            c2 = tl.maximum(lo + 2 * third, c1)
            packed = tl.sum(
                (ordered >= c1.to(tl.int32)).to(tl.int32) + ((ordered >= c2.to(tl.int32)).to(tl.int32) << 16), 0
            )
            n1 = packed & 0xFFFF
            n2 = (packed >> 16) & 0xFFFF
            hi = tl.where(n2 >= k_sel, hi, tl.where(n1 >= k_sel, c2, c1))
            lo = tl.where(n2 >= k_sel, c2, tl.where(n1 >= k_sel, c1, lo))
        v = lo.to(tl.int32)
    elif EARLY_END:  # one bit per sum, ending once a count lands on k (the library's search)
        v = tl.full([], -2147483648, tl.int32)
        one = tl.full([], 1, tl.int32)
        step = 0
        count = n_blocks
        while (step < STEPS) & (count != k_sel):
            cand = v + (one << (31 - step))
            n_ge = tl.sum((ordered >= cand).to(tl.int32), 0)
            v = tl.where(n_ge >= k_sel, cand, v)
            count = tl.where(n_ge >= k_sel, n_ge, count)
            step += 1
        tl.store(idx_ptr + tl.num_programs(0) * BLOCK_NB + row + tl.arange(0, 1), step + tl.zeros([1], tl.int32))
    else:  # one bit per sum
        v = tl.full([], -2147483648, tl.int32)
        one = tl.full([], 1, tl.int32)
        for step in tl.static_range(STEPS):
            cand = v + (one << (31 - step))
            v = tl.where(tl.sum((ordered >= cand).to(tl.int32), 0) >= k_sel, cand, v)
    above = (ordered > v) & in_range
    if ORDERED_WRITE:
        tied = (ordered == v) & in_range
        need = k_sel - tl.sum(above.to(tl.int32), 0)
        chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= need))
        slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(idx_ptr + row * k_sel + slot, tl.where(blocks > qb, -1, blocks), mask=chosen)
    else:
        tl.store(idx_ptr + row * BLOCK_NB + blocks, tl.where(above, blocks, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    t, n_rows, launches = 131072, 2, 20
    n1, n_blocks, k_sel = (t - 32) // 16 + 1, t // 64, 96
    scores = torch.rand(n_rows, n1, device="cuda") * 1e-3
    idx = torch.empty(n_rows * n_blocks + n_rows, dtype=torch.int32, device="cuda")  # the steps taken at the end
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": n_rows}
    variants = [(steps, False, False, gather, ordered) for steps, gather, ordered in itertools.product(
        (0, 8, 16, 32), (1, 0), (True, False)
    )] + [(steps, True, False, 1, True) for steps in (8, 16, 21)] + [(32, False, True, 1, False)] + [
        (steps, False, False, 2, ordered) for steps, ordered in itertools.product((0, 32), (True, False))
    ]  # fmt: skip
    variants = [(*v, 0) for v in variants] + [(0, False, False, 1, True, radix) for radix in (4, 8, 11)]
    reference = None  # the chosen blocks of the 32-step bit search, which every radix search must reproduce
    for steps, ternary, early, gather, ordered, radix in variants:
        search = f"radix{radix}" if radix else ("ternary" if ternary else ("bit_early_end" if early else "bit"))
        load = ("direct", "gather", "tile_gather")[gather]
        name = f"{search}_steps{steps}_{load}_{'ordered' if ordered else 'mask'}"

        def launch(
            steps: int = steps,
            ternary: bool = ternary,
            early: bool = early,
            gather: bool = gather,
            ordered: bool = ordered,
            radix: int = radix,
        ) -> None:
            _select_variant[(n_rows,)](
                scores, idx, n1, n_blocks, k_sel, t - 1, STEPS=steps, TERNARY=ternary, EARLY_END=early,
                GATHER=gather, ORDERED_WRITE=ordered, BLOCK_NB=n_blocks, RADIX=radix, num_warps=8,
            )  # fmt: skip

        if (steps, ternary, early, gather, ordered, radix) == (32, False, False, 1, True, 0) or radix:
            idx.fill_(-7)
            launch()
            chosen = idx[: n_rows * k_sel].clone()
            if reference is None:
                reference = chosen
            elif not torch.equal(chosen, reference):
                raise SystemExit(f"{name} chose other blocks than the 32-step bit search")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launch()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                launch()
        per_launch = 1e3 * float(do_bench(graph.replay, warmup=20, rep=200)) / launches
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        durations = [e.time_range.end - e.time_range.start for e in prof.events() if e.device_type.name == "CUDA"]
        res[name] = {"per_launch_us": per_launch, "kernel_us": statistics.median(durations) if durations else None}
        if early:
            res[name]["steps_taken"] = idx[n_rows * n_blocks :].tolist()
        steps_taken = res[name].get("steps_taken", "")
        print(f"{name:<36} {per_launch:6.2f} us per launch, kernel {res[name]['kernel_us']} {steps_taken}")
    write_results(args.out, "infllm_select_anatomy.json", res)


if __name__ == "__main__":
    main()
