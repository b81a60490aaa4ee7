"""``benchmarks/pipeline.py`` in its CPU smoke form: both quantizers end to end and ``gptq --budget``, every figure
it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--out", str(tmp_path / "out")]
    cmd += ["--preset", "tiny", "--long", "600", "--short", "128", "--short-count", "2"]
    cmd += ["--scratch", str(tmp_path / "scratch"), "--budget", "5.5bits"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "pipeline-tiny.json").read_text())
    assert res["calibration_lengths"] == [600, 128, 128]
    for method in ("gptq", "nvfp4"):
        r = res[method]
        # the loader adds one BOS per sample
        assert sum(res["calibration_lengths"]) <= r["calibration_tokens"] <= sum(res["calibration_lengths"]) + 3
        assert r["calibration_tokens_per_s"] > 0 and r["wall_s"] >= r["phase_seconds"]["calibrate_and_quantize"]
        assert {"minicpm4 mlp.down_proj", "lightning mlp.down_proj"} <= set(r["solve_seconds_per_linear"])
        assert 0 < r["export_bytes"] < 2 * res["parameters"]  # under 2 bytes per parameter: quantized
        assert len(r["generate"]["tokens"]) == 8 and r["peak_cpu_rss_gib"] > 0
        phases = r["cpu_rss_gib_by_phase"]  # sampled, so never above the process's recorded peak
        assert phases["setup"] > 0 and 0 < phases["calibration_first_layer"] <= phases["calibration_layers_max"]
        assert phases["export_and_check"] > 0
        assert max(phases.values()) <= r["peak_cpu_rss_gib"] + 0.01
    b = res["gptq_budget"]
    assert b["budget"]["achieved_bytes"] == b["budget"]["predicted_bytes"] <= b["budget"]["budget_bytes"]
    assert b["export_bytes"] > res["gptq"]["export_bytes"]  # 5.5 bits: more than uniform 4-bit
    parts = b["budget"]["search_parts_s"]
    assert set(parts) == {"load", "probe", "forward", "logits_and_kl"}
    # each figure is rounded to 0.01 s on its own, so the sum may pass the total by half a step per part
    assert 0 < sum(parts.values()) <= b["budget"]["search_seconds"] + 0.005 * (len(parts) + 1)
    # the budget's search and measurement run inside the budget run, whose wall clock is taken outside them
    searched = b["budget"]["search_seconds"] + b["budget"]["measure_seconds"]
    assert 0 < searched <= b["wall_s"] + 0.01
    assert not (tmp_path / "scratch" / "export-gptq").exists()  # exports are removed unless --keep
    assert not (tmp_path / "scratch" / "export-gptq-budget").exists()
