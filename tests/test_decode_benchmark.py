"""``benchmarks/decode.py`` in its CPU smoke form: the three formats load, decode three ways and land in the tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--out", str(tmp_path / "out")]
    cmd += ["--preset", "tiny", "--context", "40", "--new-tokens", "4", "--batches", "3", "--batch-context", "24"]
    cmd += ["--long", "300", "--device", "cpu", "--profile", "--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert list(res["rows"]) == ["bf16", "GPTQ W4A16", "NVFP4"]
    for name, row in res["rows"].items():
        assert row["before_tokens_per_s"] > 0 and row["prefill_long_s"] > 0 and row["prefill_16_s"] > 0, name
        # each rate is measured on the decode it claims: 4 new tokens, the first from the prefill, 3 timed steps;
        # the three ways decode the same tokens (one fused model, one static-cache step: the graph replays it,
        # the compiled step computes it), and their first token is the unfused model's own greedy choice
        for way in ("eager", "graph", "compiled"):
            r = row[way]
            assert r["decode_tokens_per_s"] > 0 and r["steps"] == 3 and len(r["tokens"]) == 4, (name, way)
            assert r["tokens"] == row["eager"]["tokens"], (name, way)
        assert row["eager"]["tokens"][0] == row["before_tokens"][0] and len(row["before_tokens"]) == 4, name
        batch = row["batches"]["3"]
        assert batch["decode_tokens_per_s"] > 0 and batch["steps"] == 3 and len(batch["tokens"]) == 4
        assert row["profile"]["wall_ms_per_step"] > 0
    assert not (tmp_path / "scratch").exists()  # the checkpoints are removed


def test_decode_benchmark_batches_only(tmp_path: Path) -> None:
    """``--context 0 --long 0``: the batches alone, without a batch-1 run or prefills (and their empty tables)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--out", str(tmp_path / "out")]
    cmd += ["--preset", "tiny", "--context", "0", "--long", "0", "--new-tokens", "4", "--batches", "2"]
    cmd += ["--batch-context", "24", "--formats", "GPTQ W4A16", "--device", "cpu", "--scratch", str(tmp_path / "s")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "out" / "decode.json").read_text())["rows"]["GPTQ W4A16"]
    assert set(row) == {"batches"}
    assert row["batches"]["2"]["decode_tokens_per_s"] > 0 and row["batches"]["2"]["steps"] == 3
    assert "batch 1" not in proc.stdout and "batch 2" in proc.stdout
