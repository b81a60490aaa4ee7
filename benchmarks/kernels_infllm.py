"""InfLLM-v2 sparse attention (Triton) against dense causal SDPA on one GPU: 128K prefill and decode.

Prefill: the whole sparse pipeline as the runtime runs it (``salaquant.model.sparse_attention.infllm_v2_attention``
with ``backend="triton"``: key compression, stage-1 scores, pooling + top-k in one kernel, stage 2 with the forced
blocks through the sliding-window kernel) for T queries over T keys, against ``F.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`` at the same T, with the time of each phase. Decode: one query over a T-token
cache (compressed keys already cached), eager and inside a CUDA graph, against dense SDPA decode, with each phase
eagerly and in a graph of its own. GQA 32:2, head_dim 128, bf16, SALA's sparse settings.

  python benchmarks/kernels_infllm.py --out OUT.json [--seq 131072]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from common import write_results
from triton.testing import do_bench

from salaquant.kernels import infllm
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


def _bench(fn: Callable[[], Any], rep_ms: int) -> float:
    return float(do_bench(fn, warmup=max(25, rep_ms // 10), rep=rep_ms))


def _graph_bench(fn: Callable[[], Any], rep_ms: int) -> float | str:
    """Time ``fn`` replayed from a CUDA graph (launch overhead removed); an error string if capture fails."""
    try:
        return _bench(capture_graph(fn).replay, rep_ms)
    except Exception as exc:  # report, keep the other numbers
        return f"capture failed: {type(exc).__name__}: {exc}"


def _stage1(q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, q_start: int, p: SparseParams) -> torch.Tensor:
    return infllm.stage1_scores(q, k1, k2, q_start, p.kernel_size, p.kernel_stride, p.kernel_size2, p.kernel_stride2)


def _pool_select(scores: torch.Tensor, q_start: int, tk: int, p: SparseParams, **kw: Any) -> torch.Tensor:
    return infllm.pool_select(
        scores, q_start, tk, p.block_size, p.kernel_stride, p.init_blocks, p.local_blocks, p.total_topk, **kw
    )


def _phases(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: SparseParams) -> dict[str, float]:
    """One instrumented run of the prefill pipeline (``q_start = 0``): milliseconds per phase (CUDA events)."""
    tq, tk = q.shape[1], k.shape[1]
    spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {
        name: [] for name in ("compress", "stage1", "pool_select", "stage2")
    }

    def timed(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        spans[name].append((start, end))
        return out

    def compress() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            ref.compress_keys(k, p.kernel_size, p.kernel_stride),
            ref.compress_keys(k, p.kernel_size2, p.kernel_stride2),
        )

    k1, k2 = timed("compress", compress)
    n_sel = min(p.total_topk, -(-tk // p.block_size))
    idx = torch.empty(q.shape[0], k.shape[2], tq, n_sel, dtype=torch.int32, device=q.device)
    for c0 in range(0, tq, infllm.SELECT_CHUNK):
        c1 = min(tq, c0 + infllm.SELECT_CHUNK)
        scores = timed("stage1", _stage1, q[:, c0:c1], k1, k2, c0, p)
        timed("pool_select", _pool_select, scores, c0, tk, p, out=idx[:, :, c0:c1])
        del scores

    def stage2() -> torch.Tensor:  # the forced blocks' filter included
        rest = ref.drop_forced_blocks(idx, 0, p)
        return infllm.block_sparse_attention(q, k, v, rest, 0, p.block_size, forced=(p.init_blocks, p.local_blocks))

    timed("stage2", stage2)
    torch.cuda.synchronize()
    return {name: sum(a.elapsed_time(b) for a, b in pairs) for name, pairs in spans.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or a folder for kernels_infllm.json)")
    ap.add_argument("--seq", type=int, default=131072, help="prefill length and decode context")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep-ms", type=int, default=1500, help="do_bench budget for prefill timings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    t, hq, hkv, d = args.seq, args.heads, args.kv_heads, args.head_dim
    p = SparseParams()
    q = torch.randn(1, t, hq, d, device=dev, dtype=dt)
    k = torch.randn(1, t, hkv, d, device=dev, dtype=dt)
    v = torch.randn(1, t, hkv, d, device=dev, dtype=dt)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D] for SDPA
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"seq": t, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": "bf16"},
        "sparse_params": {**dataclasses.asdict(p), "total_topk": p.total_topk},
        "select_chunk": infllm.SELECT_CHUNK,
    }

    # ---- prefill ----
    def sparse_prefill() -> torch.Tensor:
        return ref.infllm_v2_attention(q, k, v, p, backend="triton")

    def dense_prefill() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    sparse_prefill()
    torch.cuda.synchronize()
    res["prefill_sparse_ms"] = _bench(sparse_prefill, args.rep_ms)
    res["prefill_dense_sdpa_ms"] = _bench(dense_prefill, args.rep_ms)
    res["prefill_speedup"] = res["prefill_dense_sdpa_ms"] / res["prefill_sparse_ms"]
    res["prefill_dense_tflops"] = 2.0 * t * t * d * hq / res["prefill_dense_sdpa_ms"] / 1e9
    runs = [_phases(q, k, v, p) for _ in range(3)]
    res["prefill_phases_ms"] = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    res["prefill_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30

    # correctness spot check: the last 256 queries (a chunked prefill) against the reference pipeline
    k1 = ref.compress_keys(k, p.kernel_size, p.kernel_stride)
    k2 = ref.compress_keys(k, p.kernel_size2, p.kernel_stride2)
    tail = min(256, t)
    got = ref.infllm_v2_attention(q[:, -tail:], k, v, p, backend="triton")
    scores = ref.stage1_scores(q[:, -tail:], k1, k2, t - tail, p, query_chunk=64)
    idx_ref = ref.select_blocks(ref.block_scores(scores, t - tail, t, p), t - tail, p)
    want = ref.block_sparse_attention(q[:, -tail:], k, v, idx_ref, t - tail, p, query_chunk=16)
    res["prefill_tail_max_abs_err"] = float((got.float() - want.float()).abs().max())

    # ---- decode: one query over the t-token cache, compressed keys cached ----
    q1 = torch.randn(1, 1, hq, d, device=dev, dtype=dt)
    q1s = q1.transpose(1, 2).contiguous()

    def sparse_decode() -> torch.Tensor:
        return ref.infllm_v2_attention(q1, k, v, p, k1=k1, k2=k2, backend="triton")

    def dense_decode() -> torch.Tensor:
        return F.scaled_dot_product_attention(q1s, ks, vs, enable_gqa=True)

    want1 = ref.infllm_v2_attention(q1, k, v, p, k1=k1, k2=k2)
    res["decode_max_abs_err"] = float((sparse_decode().float() - want1.float()).abs().max())
    res["decode_sparse_us"] = 1e3 * _bench(sparse_decode, 300)
    res["decode_dense_sdpa_us"] = 1e3 * _bench(dense_decode, 300)
    res["decode_speedup"] = res["decode_dense_sdpa_us"] / res["decode_sparse_us"]
    g_sparse, g_dense = _graph_bench(sparse_decode, 300), _graph_bench(dense_decode, 300)
    res["decode_sparse_graph_us"] = 1e3 * g_sparse if isinstance(g_sparse, float) else g_sparse
    res["decode_dense_graph_us"] = 1e3 * g_dense if isinstance(g_dense, float) else g_dense
    if isinstance(g_sparse, float) and isinstance(g_dense, float):
        res["decode_graph_speedup"] = g_dense / g_sparse
    q_start1 = t - 1
    s1 = _stage1(q1, k1, k2, q_start1, p)
    idx1 = ref.select_blocks(ref.block_scores(s1, q_start1, t, p), q_start1, p).to(torch.int32)
    res["decode_pool_select_equals_reference"] = bool(torch.equal(_pool_select(s1, q_start1, t, p), idx1))
    phases = {
        "stage1": lambda: _stage1(q1, k1, k2, q_start1, p),
        "pool_select": lambda: _pool_select(s1, q_start1, t, p),
        "stage2": lambda: infllm.block_sparse_attention(q1, k, v, idx1, q_start1, p.block_size),
    }
    res["decode_phases_us"] = {name: 1e3 * _bench(fn, 200) for name, fn in phases.items()}
    # the same phases each replayed from its own CUDA graph: what they cost inside the decode step's graph
    res["decode_phases_graph_us"] = {}
    for name, fn in phases.items():
        ms = _graph_bench(fn, 200)
        res["decode_phases_graph_us"][name] = 1e3 * ms if isinstance(ms, float) else ms

    rows = [
        (f"prefill T={t}", res["prefill_sparse_ms"], res["prefill_dense_sdpa_ms"], "ms"),
        (f"decode ctx={t} eager", res["decode_sparse_us"], res["decode_dense_sdpa_us"], "us"),
    ]
    if "decode_graph_speedup" in res:
        rows.append((f"decode ctx={t} graph", res["decode_sparse_graph_us"], res["decode_dense_graph_us"], "us"))
    print(f"{'case':<26} {'sparse':>12} {'dense SDPA':>12} {'speedup':>8}")
    for name, sp, de, unit in rows:
        print(f"{name:<26} {sp:>10.3f}{unit} {de:>10.3f}{unit} {de / sp:>7.2f}x")
    ph = res["prefill_phases_ms"]
    print("prefill phases (ms): " + ", ".join(f"{n} {x:.2f}" for n, x in ph.items()))
    print("decode phases (us): " + ", ".join(f"{n} {x:.1f}" for n, x in res["decode_phases_us"].items()))
    graphed = [f"{n} {x if isinstance(x, str) else f'{x:.1f}'}" for n, x in res["decode_phases_graph_us"].items()]
    print("decode phases in graphs (us): " + ", ".join(graphed))
    print(f"dense SDPA {res['prefill_dense_tflops']:.0f} TFLOP/s; tail err {res['prefill_tail_max_abs_err']:.3g}")

    write_results(args.out, "kernels_infllm.json", res)


if __name__ == "__main__":
    main()
