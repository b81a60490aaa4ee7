"""``benchmarks/runtime.py`` in its CPU smoke form: the three formats load, decode and land in one table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "runtime.py"), "--out", str(tmp_path / "out")]
    cmd += ["--preset", "tiny", "--prompt", "24", "--new-tokens", "4", "--device", "cpu"]
    cmd += ["--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "runtime.json").read_text())
    assert list(res["rows"]) == ["bf16", "GPTQ W4A16", "NVFP4"]
    for name, row in res["rows"].items():
        assert row["decode_tokens_per_s"] > 0 and row["first_token_ms"] > 0, name
        assert abs(row["ms_per_token"] * row["decode_tokens_per_s"] / 1000 - 1) < 0.02, name  # one timing, two units
    assert res["rows"]["bf16"]["vs_bf16"] == 1.0
    assert not (tmp_path / "scratch").exists()  # the checkpoints are removed
