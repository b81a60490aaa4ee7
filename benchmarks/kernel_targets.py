"""All kernel benchmarks in one call, and one table of the figures the runtime is held to.

Runs ``kernels_w4a16.py``, ``kernels_nvfp4.py``, ``kernels_gla.py`` and ``kernels_infllm.py`` (each in its own
process, with its own time limit, log and JSON under OUT), then reads their JSON and prints one table: for each
target case our time, the peer's time measured in the same run, the ratio, the target and whether it is met.
Writes ``OUT/kernels.json`` (the table's rows) and ``OUT/kernels.md``.

  python benchmarks/kernel_targets.py --out OUT                         # H200: everything (each script <= 4 min)
  python benchmarks/kernel_targets.py --out OUT --only gla,infllm       # a subset
  python benchmarks/kernel_targets.py --out OUT --summarize-only        # the table from JSON already in OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS: dict[str, tuple[str, list[str], int]] = {
    # name: (script, extra arguments, time limit in seconds)
    "w4a16": ("kernels_w4a16.py", [], 240),
    "nvfp4": ("kernels_nvfp4.py", [], 240),
    "gla": ("kernels_gla.py", ["--prefill-t", "32768"], 240),
    "infllm": ("kernels_infllm.py", [], 240),
}
SALA_LAYERS = ("gate_up", "down", "lightning_qkv", "o_proj")


def run_one(name: str, out: Path) -> dict[str, Any]:
    """Run one benchmark script; its log goes to ``OUT/kernels_<name>.log``."""
    script, extra, limit = BENCHMARKS[name]
    log = out / f"kernels_{name}.log"
    cmd = [sys.executable, str(HERE / script), "--out", str(out), *extra]
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    return {"name": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": log.name}


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"kernels_{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _row(
    case: str, ours: float | None, peer: float | None, peer_name: str, unit: str, target: str, ok: bool | None
) -> dict[str, Any]:
    ratio = peer / ours if ours and peer else None
    return {
        "case": case,
        "ours": ours,
        "peer": peer,
        "peer_name": peer_name,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": ok,
    }


def gemm_rows(data: dict[str, Any] | None, kind: str) -> list[dict[str, Any]]:
    """Rows for the GEMM targets: >= 3.0x cuBLAS at M=1 on gate_up and down, >= 2.5x at M=16, the prefill
    (M=4096) within 1.3x of cuBLAS; the other layers are listed against the same M=1 / M=16 bars."""
    if not data:
        return []
    rows = []
    for r in data.get("rows", []):
        if r.get("layer") not in SALA_LAYERS or r.get("M") not in (1, 16, 4096):
            continue
        ours, peer = r.get("ours_us"), r.get("cublas_us")
        m = r["M"]
        ratio = peer / ours if ours and peer else None
        if m == 4096:
            target, ok = "time <= 1.3x cuBLAS", None if ratio is None else ratio >= 1 / 1.3
        else:
            bar = 3.0 if m == 1 else 2.5
            target, ok = f">= {bar}x cuBLAS", None if ratio is None else ratio >= bar
        rows.append(_row(f"{kind} {r['layer']} M={m}", ours, peer, "cuBLAS bf16", "us", target, ok))
    return rows


def gla_rows(data: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chunked prefill at T=32768 against fla on bf16 inputs: with bf16 dots and a bf16 output (fla's own output
    dtype), and upcast to fp32 with TF32 dots and a bf16 output (the runtime's case: the model computes GLA in
    fp32); recurrent decode at each B."""
    if not data:
        return []
    rows = []
    cases = (
        ("bfloat16", "-", False, "bf16 in, bf16 out, as fla"),
        ("bfloat16", "tf32", True, "bf16 in computed in fp32 (TF32), bf16 out, the runtime"),
    )
    for dtype, precision, upcast, label in cases:
        picked = [
            r
            for r in data.get("rows", [])
            if r.get("kernel") == "chunk"
            and r.get("dtype") == dtype
            and r.get("precision") == precision
            and r.get("out_dtype") == "bfloat16"
            and bool(r.get("upcast")) == upcast
            and r.get("ours_ms")
        ]
        for r in sorted(picked, key=lambda r: r["T"]):
            ratio = r["fla_ms"] / r["ours_ms"] if r.get("fla_ms") else None
            rows.append(
                _row(
                    f"GLA chunk prefill T={r['T']}, {label}",
                    r["ours_ms"],
                    r.get("fla_ms"),
                    "fla chunk_simple_gla",
                    "ms",
                    ">= 1.0x fla",
                    None if ratio is None else ratio >= 1.0,
                )
            )
    for r in data.get("rows", []):
        if r.get("kernel") == "recurrent" and r.get("mode") == "new_state":
            ratio = r["fla_ms"] / r["ours_ms"] if r.get("fla_ms") and r.get("ours_ms") else None
            rows.append(
                _row(
                    f"GLA recurrent decode B={r['B']}",
                    r.get("ours_ms"),
                    r.get("fla_ms"),
                    "fla fused_recurrent_simple_gla",
                    "ms",
                    ">= 1.0x fla",
                    None if ratio is None else ratio >= 1.0,
                )
            )
    return rows


def infllm_rows(data: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Sparse prefill at the benchmark's T (>= 8x SDPA dense causal) and a decode step (CUDA graph, >= 5x)."""
    if not data:
        return []
    t = data.get("shape", {}).get("seq")
    pre = _row(
        f"InfLLM-v2 prefill T={t}",
        data.get("prefill_sparse_ms"),
        data.get("prefill_dense_sdpa_ms"),
        "SDPA dense causal",
        "ms",
        ">= 8x dense",
        None,
    )
    pre["met"] = None if pre["ratio"] is None else pre["ratio"] >= 8.0
    dec = _row(
        f"InfLLM-v2 decode ctx={t} (CUDA graph)",
        data.get("decode_sparse_graph_us") if isinstance(data.get("decode_sparse_graph_us"), float) else None,
        data.get("decode_dense_graph_us") if isinstance(data.get("decode_dense_graph_us"), float) else None,
        "SDPA dense",
        "us",
        ">= 5x dense",
        None,
    )
    dec["met"] = None if dec["ratio"] is None else dec["ratio"] >= 5.0
    return [pre, dec]


def summary_rows(out: Path) -> list[dict[str, Any]]:
    return (
        gemm_rows(_load(out, "w4a16"), "W4A16 g128")
        + gemm_rows(_load(out, "nvfp4"), "NVFP4")
        + gla_rows(_load(out, "gla"))
        + infllm_rows(_load(out, "infllm"))
    )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | ours | peer (same run) | ratio | target | met |", "|---|---|---|---|---|---|"]
    for r in rows:
        spec = ".4f" if r["unit"] == "ms" else ".1f"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(
            f"| {r['case']} | {_fmt(r['ours'], spec)} {r['unit']} | {r['peer_name']} {_fmt(r['peer'], spec)} "
            f"{r['unit']} | {_fmt(r['ratio'], '.2f')}x | {r['target']} | {met} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for every benchmark's JSON and log")
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of " + ",".join(BENCHMARKS))
    ap.add_argument("--summarize-only", action="store_true", help="only build the table from JSON in OUT")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    if not args.summarize_only:
        names = [n for n in args.only.split(",") if n]
        unknown = sorted(set(names) - set(BENCHMARKS))
        if unknown:
            raise SystemExit(f"unknown benchmarks {unknown}; choose from {sorted(BENCHMARKS)}")
        for name in names:
            runs.append(run_one(name, args.out))
            print(f"{name}: rc {runs[-1]['rc']} in {runs[-1]['seconds']} s", flush=True)
    rows = summary_rows(args.out)
    text = table(rows)
    (args.out / "kernels.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=2))
    (args.out / "kernels.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
