"""InfLLM-v2 sparse attention (Triton) against dense causal SDPA on one GPU: 128K prefill and decode.

Prefill: the whole sparse pipeline (key compression, stage-1 scores, max-pool + top-k in PyTorch, stage-2
block-sparse attention) for T queries over T keys, against ``F.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`` at the same T. Decode: one query over a T-token cache (compressed keys
already cached; pooling and top-k in one Triton kernel), eager and inside a CUDA graph, against dense SDPA
decode. GQA 32:2, head_dim 128, bf16,
SALA's sparse settings.

  python benchmarks/kernels_infllm.py --out OUT.json [--seq 131072] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from infllm_decode import capture_graph
from results import write_results
from salaquant.kernels import infllm
from salaquant.kernels.infllm import triton_kernels
from triton.testing import do_bench

from salaquant.model import sparse_attention as ref
from salaquant.model.sparse_attention import SparseParams


def _bench(fn: Callable[[], Any], rep_ms: int) -> float:
    return float(do_bench(fn, warmup=max(25, rep_ms // 10), rep=rep_ms))


def _graph_bench(fn: Callable[[], Any], rep_ms: int) -> float | str:
    """Time ``fn`` replayed from a CUDA graph (launch overhead removed); an error string if capture fails."""
    try:
        return _bench(capture_graph(fn).replay, rep_ms)
    except Exception as exc:  # report, keep the other numbers
        return f"capture failed: {type(exc).__name__}: {exc}"


def _phases(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: SparseParams, chunk: int) -> dict[str, float]:
    """One instrumented run of the prefill pipeline (``q_start = 0``): milliseconds per phase (CUDA events).

    The one-kernel pooling + top-k is timed beside the reference's on the same scores, with the rows where
    they differ."""
    tq, tk = q.shape[1], k.shape[1]
    spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {
        name: [] for name in ("compress", "stage1", "pool_topk", "pool_select_kernel", "stage2", "stage2_local_dense")
    }

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        spans[name].append((start, end))
        return out

    def compress() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            ref.compress_keys(k, p.kernel_size, p.kernel_stride),
            ref.compress_keys(k, p.kernel_size2, p.kernel_stride2),
        )

    def select(scores: torch.Tensor, c0: int) -> torch.Tensor:
        return ref.select_blocks(ref.block_scores(scores, c0, tk, p), c0, p)

    mismatched_rows = [0]
    k1, k2 = timed("compress", compress)
    n_sel = min(p.total_topk, -(-tk // p.block_size))
    idx = torch.empty(q.shape[0], k.shape[2], tq, n_sel, dtype=torch.int32, device=q.device)
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        scores = timed("stage1", triton_kernels.stage1_scores, q[:, c0:c1], k1, k2, c0, p)
        idx[:, :, c0:c1] = timed("pool_topk", select, scores, c0)
        # the one-kernel pooling + top-k on the same scores (not used below: the reference's choice is)
        mine = timed("pool_select_kernel", triton_kernels.pool_select, scores, c0, tk, p)
        mismatched_rows[0] += int((mine != idx[:, :, c0:c1]).any(dim=-1).sum())
        del scores, mine
    timed("stage2", triton_kernels.block_sparse_attention, q, k, v, idx, 0, p)
    # forced blocks through the sliding-window kernel, the rest per query (the forced-block filter included)
    timed("stage2_local_dense", lambda: triton_kernels.block_sparse_attention(q, k, v, idx, 0, p, local_dense=True))
    torch.cuda.synchronize()
    times = {name: sum(a.elapsed_time(b) for a, b in pairs) for name, pairs in spans.items()}
    return {**times, "pool_select_kernel_mismatched_rows": float(mismatched_rows[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or a folder for kernels_infllm.json)")
    ap.add_argument("--seq", type=int, default=131072, help="prefill length and decode context")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--select-chunk", type=int, default=infllm.SELECT_CHUNK)
    ap.add_argument("--rep-ms", type=int, default=1500, help="do_bench budget for prefill timings")
    ap.add_argument("--sweep", action="store_true", help="also time a few launch configurations per kernel")
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
        "select_chunk": args.select_chunk,
    }

    # ---- prefill ----
    def sparse_prefill() -> torch.Tensor:
        return infllm.infllm_v2_attention(q, k, v, p, backend="triton", select_chunk=args.select_chunk)

    def dense_prefill() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    sparse_prefill()
    torch.cuda.synchronize()
    res["prefill_sparse_ms"] = _bench(sparse_prefill, args.rep_ms)
    res["prefill_dense_sdpa_ms"] = _bench(dense_prefill, args.rep_ms)
    res["prefill_speedup"] = res["prefill_dense_sdpa_ms"] / res["prefill_sparse_ms"]

    def sparse_prefill_reference_select() -> torch.Tensor:  # pooling + top-k in PyTorch (the earlier default)
        return infllm.infllm_v2_attention(
            q, k, v, p, backend="triton", select_chunk=args.select_chunk, kernel_select=False
        )

    def sparse_prefill_gathered() -> torch.Tensor:  # forced blocks gathered per query like the others
        return infllm.infllm_v2_attention(
            q, k, v, p, backend="triton", select_chunk=args.select_chunk, local_dense=False
        )

    res["prefill_gathered_max_abs_diff"] = float((sparse_prefill_gathered() - sparse_prefill()).abs().max())
    res["prefill_sparse_gathered_ms"] = _bench(sparse_prefill_gathered, args.rep_ms)
    res["prefill_gathered_speedup"] = res["prefill_dense_sdpa_ms"] / res["prefill_sparse_gathered_ms"]

    sparse_prefill_reference_select()
    res["prefill_sparse_reference_select_ms"] = _bench(sparse_prefill_reference_select, args.rep_ms)
    res["prefill_reference_select_speedup"] = res["prefill_dense_sdpa_ms"] / res["prefill_sparse_reference_select_ms"]
    res["prefill_dense_tflops"] = 2.0 * t * t * d * hq / res["prefill_dense_sdpa_ms"] / 1e9
    runs = [_phases(q, k, v, p, args.select_chunk) for _ in range(3)]
    res["prefill_phases_ms"] = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    res["prefill_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30

    k1 = ref.compress_keys(k, p.kernel_size, p.kernel_stride)
    k2 = ref.compress_keys(k, p.kernel_size2, p.kernel_stride2)
    # stage 1 alone over every chunk with bf16 compressed keys (bf16 dots: what compress_keys gives for bf16 keys,
    # as the model's own mean does) and with fp32 ones (TF32 dots, the earlier choice): the cost of the precision
    for name, (ka, kb) in (("fp32", (k1.float(), k2.float())), ("bf16", (k1.bfloat16(), k2.bfloat16()))):

        def stage1_all(ka: torch.Tensor = ka, kb: torch.Tensor = kb) -> None:
            for c0 in range(0, t, args.select_chunk):
                triton_kernels.stage1_scores(q[:, c0 : c0 + args.select_chunk], ka, kb, c0, p)

        stage1_all()
        res[f"prefill_stage1_{name}_keys_ms"] = _bench(stage1_all, args.rep_ms // 3)

    # correctness spot check: the last 256 queries (a chunked prefill) against the reference pipeline
    tail = min(256, t)
    got = infllm.infllm_v2_attention(q[:, -tail:], k, v, p, backend="triton")
    scores = ref.stage1_scores(q[:, -tail:], k1, k2, t - tail, p, query_chunk=64)
    idx_ref = ref.select_blocks(ref.block_scores(scores, t - tail, t, p), t - tail, p)
    want = ref.block_sparse_attention(q[:, -tail:], k, v, idx_ref, t - tail, p, query_chunk=16)
    res["prefill_tail_max_abs_err"] = float((got.float() - want.float()).abs().max())

    # ---- decode: one query over the t-token cache, compressed keys cached ----
    q1 = torch.randn(1, 1, hq, d, device=dev, dtype=dt)
    q1s = q1.transpose(1, 2).contiguous()

    def sparse_decode() -> torch.Tensor:
        return infllm.infllm_v2_attention(q1, k, v, p, k1=k1, k2=k2, backend="triton")

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
    s1 = triton_kernels.stage1_scores(q1, k1, k2, q_start1, p)
    idx1 = ref.select_blocks(ref.block_scores(s1, q_start1, t, p), q_start1, p).to(torch.int32)
    res["decode_pool_select_equals_reference"] = bool(torch.equal(triton_kernels.pool_select(s1, q_start1, t, p), idx1))
    res["decode_phases_us"] = {
        "stage1": 1e3 * _bench(lambda: triton_kernels.stage1_scores(q1, k1, k2, q_start1, p), 200),
        "pool_topk_reference": 1e3
        * _bench(lambda: ref.select_blocks(ref.block_scores(s1, q_start1, t, p), q_start1, p), 200),
        "pool_select": 1e3 * _bench(lambda: triton_kernels.pool_select(s1, q_start1, t, p), 200),
        "stage2": 1e3 * _bench(lambda: triton_kernels.block_sparse_attention(q1, k, v, idx1, q_start1, p), 200),
    }
    # the same phases each replayed from its own CUDA graph: what they cost inside the decode step's graph
    graph_phases = {
        "stage1": lambda: triton_kernels.stage1_scores(q1, k1, k2, q_start1, p),
        "pool_select": lambda: triton_kernels.pool_select(s1, q_start1, t, p),
        "stage2": lambda: triton_kernels.block_sparse_attention(q1, k, v, idx1, q_start1, p),
    }
    res["decode_phases_graph_us"] = {}
    for name, fn in graph_phases.items():
        ms = _graph_bench(fn, 200)
        res["decode_phases_graph_us"][name] = 1e3 * ms if isinstance(ms, float) else ms
    # launch choices of each decode phase, each in its own graph (defaults: pool_select 8 warps; stage 1 128 splits
    # of the windows, 8 warps; stage 2 48 splits of the 96 blocks): what the defaults should be
    defaults = {"pool_select": idx1, "stage1": s1, "stage2": graph_phases["stage2"]()}
    variants: dict[str, tuple[str, Callable[[], Any]]] = {}
    for warps in (4, 16):
        variants[f"pool_select_warps{warps}"] = (
            "pool_select",
            lambda warps=warps: triton_kernels.pool_select(s1, q_start1, t, p, num_warps=warps),
        )
    for splits, warps in itertools.product((16, 32, 64, 128), (4, 8)):
        variants[f"stage1_splits{splits}_warps{warps}"] = (
            "stage1",
            lambda splits=splits, warps=warps: triton_kernels.stage1_scores(
                q1, k1, k2, q_start1, p, num_splits=splits, num_warps=warps
            ),
        )
    for splits in (12, 24, 48, 96):
        variants[f"stage2_splits{splits}"] = (
            "stage2",
            lambda splits=splits: triton_kernels.block_sparse_attention(q1, k, v, idx1, q_start1, p, num_splits=splits),
        )
    res["decode_sweep_graph_us"], res["decode_sweep_max_abs_diff"] = {}, {}
    for name, (phase, fn) in variants.items():
        try:  # each variant's result against the default launch's
            diff = float((fn().float() - defaults[phase].float()).abs().max())
        except Exception as exc:  # a launch choice that fails is recorded, the rest still run
            res["decode_sweep_graph_us"][name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            continue
        res["decode_sweep_max_abs_diff"][name] = diff
        ms = _graph_bench(fn, 100)
        res["decode_sweep_graph_us"][name] = 1e3 * ms if isinstance(ms, float) else ms

    # ---- optional launch-configuration sweep ----
    if args.sweep:
        sweep: dict[str, float | str] = {}
        c = min(args.select_chunk, t)
        qc = q[:, -c:]
        for n_rows, warps in ((64, 4), (64, 8), (128, 4), (128, 8)):
            key = f"stage1_last{c}_rows{n_rows}_warps{warps}_ms"
            try:
                sweep[key] = _bench(
                    lambda n_rows=n_rows, warps=warps: triton_kernels.stage1_scores(
                        qc, k1, k2, t - c, p, block_rows=n_rows, num_warps=warps
                    ),
                    args.rep_ms // 3,
                )
            except Exception as exc:
                sweep[key] = f"failed: {exc}"
        idx = torch.empty(1, hkv, t, min(p.total_topk, -(-t // p.block_size)), dtype=torch.int32, device=dev)
        for c0 in range(0, t, args.select_chunk):
            c1 = min(t, c0 + args.select_chunk)
            sc = triton_kernels.stage1_scores(q[:, c0:c1], k1, k2, c0, p)
            idx[:, :, c0:c1] = ref.select_blocks(ref.block_scores(sc, c0, t, p), c0, p)
            del sc
        for warps in (2, 4, 8):
            for stages in (1, 2):
                key = f"stage2_warps{warps}_stages{stages}_ms"
                try:
                    sweep[key] = _bench(
                        lambda warps=warps, stages=stages: triton_kernels.block_sparse_attention(
                            q, k, v, idx, 0, p, num_warps=warps, num_stages=stages
                        ),
                        args.rep_ms // 3,
                    )
                except Exception as exc:
                    sweep[key] = f"failed: {exc}"
        res["sweep"] = sweep

    rows = [
        (f"prefill T={t}", res["prefill_sparse_ms"], res["prefill_dense_sdpa_ms"], "ms"),
        (
            f"prefill T={t} gathered",
            res["prefill_sparse_gathered_ms"],
            res["prefill_dense_sdpa_ms"],
            "ms",
        ),
        (
            f"prefill T={t} PyTorch select",
            res["prefill_sparse_reference_select_ms"],
            res["prefill_dense_sdpa_ms"],
            "ms",
        ),
        (f"decode ctx={t} eager", res["decode_sparse_us"], res["decode_dense_sdpa_us"], "us"),
    ]
    if "decode_graph_speedup" in res:
        rows.append((f"decode ctx={t} graph", res["decode_sparse_graph_us"], res["decode_dense_graph_us"], "us"))
    print(f"{'case':<26} {'sparse':>12} {'dense SDPA':>12} {'speedup':>8}")
    for name, sp, de, unit in rows:
        print(f"{name:<26} {sp:>10.3f}{unit} {de:>10.3f}{unit} {de / sp:>7.2f}x")
    ph = res["prefill_phases_ms"]
    print("prefill phases (ms): " + ", ".join(f"{n} {x:.2f}" for n, x in ph.items()))
    print(
        f"stage 1 alone: fp32 keys {res['prefill_stage1_fp32_keys_ms']:.2f} ms, "
        f"bf16 keys {res['prefill_stage1_bf16_keys_ms']:.2f} ms"
    )
    print("decode phases (us): " + ", ".join(f"{n} {x:.1f}" for n, x in res["decode_phases_us"].items()))
    graphed = [f"{n} {x if isinstance(x, str) else f'{x:.1f}'}" for n, x in res["decode_phases_graph_us"].items()]
    print("decode phases in graphs (us): " + ", ".join(graphed))
    diffs = res["decode_sweep_max_abs_diff"]
    sweep = [
        f"{n} {x if isinstance(x, str) else f'{x:.1f}'} (diff {diffs.get(n, float('nan')):.2g})"
        for n, x in res["decode_sweep_graph_us"].items()
    ]
    print("decode launch choices in graphs (us): " + ", ".join(sweep))
    print(f"dense SDPA {res['prefill_dense_tflops']:.0f} TFLOP/s; tail err {res['prefill_tail_max_abs_err']:.3g}")
    if args.sweep:
        for key, val in res["sweep"].items():
            print(f"  {key}: {val if isinstance(val, str) else f'{val:.3f}'}")

    write_results(args.out, "kernels_infllm.json", res)


if __name__ == "__main__":
    main()
