"""``benchmarks/kernel_targets.py``: the one-table summary built from each kernel benchmark's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _write(out: Path) -> None:
    w4 = {
        "rows": [
            {"layer": "gate_up", "M": 1, "ours_us": 20.0, "cublas_us": 63.0},
            {"layer": "gate_up", "M": 16, "ours_us": 30.0, "cublas_us": 64.0},
            {"layer": "gate_up", "M": 128, "ours_us": 100.0, "cublas_us": 72.0},  # no target at M=128
            {"layer": "gate_up", "M": 4096, "ours_us": 2200.0, "cublas_us": 1618.0},
        ]
    }
    gla = {
        "rows": [
            {
                "kernel": "chunk",
                "T": 32768,
                "dtype": "bfloat16",
                "precision": "-",
                "out_dtype": "float32",
                "ours_ms": 0.5,
                "fla_ms": 0.78,
            },  # fp32 output: not a reported case
            {
                "kernel": "chunk",
                "T": 32768,
                "dtype": "bfloat16",
                "precision": "-",
                "out_dtype": "bfloat16",
                "ours_ms": 0.65,
                "fla_ms": 0.78,
            },
            {
                "kernel": "chunk",
                "T": 32768,
                "dtype": "bfloat16",
                "precision": "tf32",
                "upcast": True,
                "out_dtype": "bfloat16",
                "ours_ms": 2.0,
                "fla_ms": 1.8,
            },
            {
                "kernel": "chunk",
                "T": 32768,
                "dtype": "float32",
                "precision": "tf32",
                "out_dtype": "bfloat16",
                "ours_ms": 0.1,
                "fla_ms": 1.8,
            },  # fp32 inputs: not a reported case
            {"kernel": "recurrent", "B": 8, "mode": "new_state", "ours_ms": 0.022, "fla_ms": 0.151},
            {"kernel": "recurrent", "B": 8, "mode": "inplace", "ours_ms": 0.02, "fla_ms": 0.151},
        ]
    }
    infllm = {
        "shape": {"seq": 131072},
        "prefill_sparse_ms": 200.0,
        "prefill_dense_sdpa_ms": 250.0,
        "decode_sparse_graph_us": 10.0,
        "decode_dense_graph_us": 50.0,
    }
    for name, data in (("w4a16", w4), ("gla", gla), ("infllm", infllm)):
        (out / f"kernels_{name}.json").write_text(json.dumps(data))


def test_summary_ratios_and_targets(tmp_path: Path) -> None:
    _write(tmp_path)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_targets.py"), "--out", str(tmp_path), "--summarize-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads((tmp_path / "kernels.json").read_text())["rows"]}
    # hand-computed: 63 / 20 = 3.15 >= 3.0; 64 / 30 = 2.13 < 2.5; 1618 / 2200 = 0.735 < 1 / 1.3 = 0.769
    m1, m16, m4096 = (rows[f"W4A16 g128 gate_up M={m}"] for m in (1, 16, 4096))
    assert m1["ratio"] == pytest.approx(3.15) and m1["met"] is True
    assert m16["ratio"] == pytest.approx(64 / 30) and m16["met"] is False
    assert m4096["ratio"] == pytest.approx(1618 / 2200) and m4096["met"] is False
    assert not any("M=128" in case for case in rows) and not any(case.startswith("NVFP4") for case in rows)
    gla = [case for case in rows if case.startswith("GLA chunk")]
    assert len(gla) == 2
    as_fla = rows["GLA chunk prefill T=32768, bf16 in, bf16 out, as fla"]
    runtime = rows["GLA chunk prefill T=32768, bf16 in computed in fp32 (TF32), bf16 out, the runtime"]
    assert as_fla["ratio"] == pytest.approx(1.2) and as_fla["met"] is True
    assert runtime["ratio"] == pytest.approx(0.9) and runtime["met"] is False
    assert rows["GLA recurrent decode B=8"]["ours"] == 0.022  # the new-state mode, not the in-place one
    assert rows["InfLLM-v2 prefill T=131072"]["met"] is False  # 1.25x < 8x
    assert rows["InfLLM-v2 decode ctx=131072 (CUDA graph)"]["ratio"] == pytest.approx(5.0)
    assert rows["InfLLM-v2 decode ctx=131072 (CUDA graph)"]["met"] is True
    md = (tmp_path / "kernels.md").read_text()
    assert "| W4A16 g128 gate_up M=1 | 20.0 us | cuBLAS bf16 63.0 us | 3.15x | >= 3.0x cuBLAS | yes |" in md


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_targets.py"), "--out", str(tmp_path), "--only", "gemm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown benchmarks ['gemm']" in proc.stderr
