"""InfLLM-v2 sparse decode step against dense SDPA decode at a long context, on one GPU.

One query token (GQA 32:2, head_dim 128, bf16, SALA's sparse settings) over a ``--seq``-token cache whose
compressed keys are cached. Each step is captured in a CUDA graph and timed two ways: ``do_bench`` of one
replay (the graph launch and synchronisation included) and the mean of 50 back-to-back replays (what the step
costs inside a longer decode graph). The kernels of one step come from the profiler, with their start and end
inside the step; the step is timed again with every kernel launched plainly (no programmatic dependent
launch) and with the selection's bit search and 8-bit radix select instead of its interpolation search, and
launch choices of each kernel are swept in graphs of their own.

  python benchmarks/infllm_decode.py --out OUT.json [--seq 131072]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from results import write_results
from salaquant.kernels import infllm
from salaquant.kernels.infllm import launch, select, triton_kernels
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from salaquant.model import sparse_attention as ref
from salaquant.model.sparse_attention import SparseParams


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after three warm-up calls on the capturing stream (so that buffers the
    kernels cache per stream exist before the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    return 1e3 * float(do_bench(graph.replay, warmup=50, rep=300))


def _back_to_back_us(graph: torch.cuda.CUDAGraph, n: int = 50) -> float:
    def once() -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return 1e3 * start.elapsed_time(end) / n

    return statistics.median(once() for _ in range(7))


def _timeline(graph: torch.cuda.CUDAGraph, steps: int = 20) -> list[tuple[str, float, float]]:
    """(kernel, start, end) in microseconds from the first kernel's start, for one replay in the middle."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per_step = len(events) // steps
    one = events[(steps // 2) * per_step : (steps // 2 + 1) * per_step]
    t0 = one[0].time_range.start
    return [(e.name[:48], e.time_range.start - t0, e.time_range.end - t0) for e in one]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or a folder for infllm_decode.json)")
    ap.add_argument("--seq", type=int, default=131072)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    t, hq, hkv, d = args.seq, 32, 2, 128
    p = SparseParams()
    k = torch.randn(1, t, hkv, d, device=dev, dtype=dt)
    v = torch.randn(1, t, hkv, d, device=dev, dtype=dt)
    q = torch.randn(1, 1, hq, d, device=dev, dtype=dt)
    k1 = ref.compress_keys(k, p.kernel_size, p.kernel_stride)
    k2 = ref.compress_keys(k, p.kernel_size2, p.kernel_stride2)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "seq": t,
    }

    def sparse() -> torch.Tensor:
        return infllm.infllm_v2_attention(q, k, v, p, k1=k1, k2=k2, backend="triton")

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    want = ref.infllm_v2_attention(q, k, v, p, k1=k1, k2=k2)
    res["max_abs_err_vs_reference"] = float((sparse().float() - want.float()).abs().max())
    g_sparse, g_dense = capture_graph(sparse), capture_graph(dense)
    res["sparse_replay_us"], res["dense_replay_us"] = _replay_us(g_sparse), _replay_us(g_dense)
    res["sparse_back_to_back_us"], res["dense_back_to_back_us"] = _back_to_back_us(g_sparse), _back_to_back_us(g_dense)
    res["speedup_replay"] = res["dense_replay_us"] / res["sparse_replay_us"]
    res["speedup_back_to_back"] = res["dense_back_to_back_us"] / res["sparse_back_to_back_us"]
    res["sparse_timeline_us"] = _timeline(g_sparse)
    res["dense_timeline_us"] = _timeline(g_dense)
    # the same step with every kernel launched plainly (no programmatic dependent launch)
    launch.USE_PDL = False
    g_plain = capture_graph(sparse)
    res["sparse_no_pdl_replay_us"] = _replay_us(g_plain)
    res["sparse_no_pdl_back_to_back_us"] = _back_to_back_us(g_plain)
    res["sparse_no_pdl_timeline_us"] = _timeline(g_plain)
    launch.USE_PDL = True
    # the same step with the selection's bit search and its radix select (8 bits per pass) instead of the
    # interpolation search
    default_interpolate, default_radix = select.SELECT_INTERPOLATE, select.SELECT_RADIX
    select.SELECT_INTERPOLATE = False
    for name, radix in (("bits", 0), ("radix8", 8)):
        select.SELECT_RADIX = radix
        res[f"{name}_max_abs_err_vs_reference"] = float((sparse().float() - want.float()).abs().max())
        g_search = capture_graph(sparse)
        res[f"sparse_{name}_replay_us"] = _replay_us(g_search)
        res[f"sparse_{name}_back_to_back_us"] = _back_to_back_us(g_search)
        res[f"sparse_{name}_timeline_us"] = _timeline(g_search)
    select.SELECT_INTERPOLATE, select.SELECT_RADIX = default_interpolate, default_radix

    # launch choices, each kernel in a graph of its own, with its largest difference from the default launch
    q_start = t - 1
    scores = triton_kernels.stage1_scores(q, k1, k2, q_start, p)
    idx = triton_kernels.pool_select(scores, q_start, t, p)
    res["pool_select_equals_reference"] = bool(
        torch.equal(idx.long(), ref.select_blocks(ref.block_scores(scores, q_start, t, p), q_start, p))
    )
    attn = triton_kernels.block_sparse_attention(q, k, v, idx, q_start, p)
    variants: dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
    for warps, interpolate in itertools.product((4, 8, 16), (True, False)):
        variants[f"pool_select_warps{warps}" + ("" if interpolate else "_bits")] = (
            idx,
            lambda warps=warps, interpolate=interpolate: triton_kernels.pool_select(
                scores, q_start, t, p, num_warps=warps, interpolate=interpolate
            ),
        )
    for splits, warps in itertools.product((64, 128, 256), (4, 8)):
        variants[f"stage1_splits{splits}_warps{warps}"] = (
            scores,
            lambda splits=splits, warps=warps: triton_kernels.stage1_scores(
                q, k1, k2, q_start, p, num_splits=splits, num_warps=warps
            ),
        )
    for splits, warps in itertools.product((24, 48, 96), (4, 8)):
        variants[f"stage2_splits{splits}_warps{warps}"] = (
            attn,
            lambda splits=splits, warps=warps: triton_kernels.block_sparse_attention(
                q, k, v, idx, q_start, p, num_splits=splits, num_warps=warps
            ),
        )
    res["variants_us"], res["variants_max_abs_diff"] = {}, {}
    for name, (default, fn) in variants.items():
        try:
            res["variants_max_abs_diff"][name] = float((fn().float() - default.float()).abs().max())
            graph = capture_graph(fn)
            res["variants_us"][name] = {"replay": _replay_us(graph), "back_to_back": _back_to_back_us(graph)}
        except Exception as exc:  # a failing launch choice is recorded, the rest still run
            res["variants_us"][name] = f"failed: {type(exc).__name__}: {exc}"[:300]

    print(
        f"decode ctx={t}: sparse {res['sparse_replay_us']:.1f} us, dense {res['dense_replay_us']:.1f} us "
        f"({res['speedup_replay']:.2f}x) per replay; back to back {res['sparse_back_to_back_us']:.1f} / "
        f"{res['dense_back_to_back_us']:.1f} us ({res['speedup_back_to_back']:.2f}x)"
    )
    for name, start, end in res["sparse_timeline_us"]:
        print(f"  {name:<48} {start:6.2f} -> {end:6.2f} us ({end - start:.2f})")
    print(
        f"without programmatic dependent launch: {res['sparse_no_pdl_replay_us']:.1f} us per replay, "
        f"{res['sparse_no_pdl_back_to_back_us']:.1f} us back to back"
    )
    for name, start, end in res["sparse_no_pdl_timeline_us"]:
        print(f"  {name:<48} {start:6.2f} -> {end:6.2f} us ({end - start:.2f})")
    for name, val in res["variants_us"].items():
        diff = res["variants_max_abs_diff"].get(name, float("nan"))
        text = val if isinstance(val, str) else f"{val['replay']:.1f} / {val['back_to_back']:.1f} us"
        print(f"  {name:<28} {text} (diff {diff:.2g})")
    write_results(args.out, "infllm_decode.json", res)


if __name__ == "__main__":
    main()
