"""``benchmarks/pipeline.py`` in its CPU smoke form: both quantizers end to end and ``gptq --budget``, every figure
it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from salaquant.model.tiny import preset_config

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """The module ``benchmarks/NAME.py`` (the benchmarks import each other as top-level modules)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


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
        assert set(r["layer_sha256"]) == {"-1", *map(str, range(preset_config("tiny")["num_hidden_layers"]))}
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


def test_trace_summary_by_hand() -> None:
    """The GPU profile's figures from a hand-made trace: busy time is the union of kernel intervals (overlapping
    streams count once), copies apart, marker kernels split the timeline into passes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from pipeline import trace_summary
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def event(name: str, start_ms: float, ms: float, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3, "dur": ms * 1e3}  # microseconds

    events = [
        event("void spin_kernel(long)", 0, 0.001),  # pass:statistics from 0
        event("gemm", 100, 400),  # 100-500 ms
        event("gemm", 300, 400),  # 300-700 ms on another stream: busy 100-700
        event("Memcpy HtoD", 700, 250, cat="gpu_memcpy"),
        event("void spin_kernel(long)", 1000, 0.001),  # pass:quantize from 1 s
        event("solve", 1500, 200),  # 1.5-1.7 s
        event("void spin_kernel(long)", 2000, 0.001),  # the layer's end at 2 s
        event("aten::mm", 0, 5000, cat="cpu_op"),  # host time: not the GPU's
    ]
    r = trace_summary(events, ["pass:statistics", "pass:quantize", "end"], wall_s=4.0, top=1)
    assert r["passes"] == {"statistics": {"s": 1.0, "gpu_busy_s": 0.6}, "quantize": {"s": 1.0, "gpu_busy_s": 0.2}}
    assert r["busy_s"] == 0.8 and r["busy_fraction"] == 0.2 and r["kernel_sum_s"] == 1.0 and r["copy_sum_s"] == 0.25
    assert r["kernels"] == 3 and r["markers"] == {"launched": 3, "found": 3}
    assert r["top"] == [{"name": "gemm", "s": 0.8, "calls": 2}]


def test_layer_digests_find_the_layer_that_differs(tmp_path: Path) -> None:
    """Two exports, the second sharded differently and with one value of layer 1 changed: every digest but layer
    1's is the same (by name, not by shard), and layer 1's differs."""
    import torch
    from safetensors.torch import save_file

    layer_digests = _benchmark("pipeline").layer_digests
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.qweight": torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int32),
        "model.layers.1.mlp.down_proj.weight_scale": torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn),
        "model.layers.10.input_layernorm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }
    (tmp_path / "a").mkdir()
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    changed = dict(tensors)
    scale = changed["model.layers.1.mlp.down_proj.weight_scale"].clone()
    scale.view(torch.uint8)[0, 0] ^= 1  # one bit of one value
    changed["model.layers.1.mlp.down_proj.weight_scale"] = scale
    (tmp_path / "b").mkdir()
    names = sorted(changed)
    save_file({k: changed[k] for k in names[:2]}, str(tmp_path / "b" / "model-00001-of-00002.safetensors"))
    save_file({k: changed[k] for k in names[2:]}, str(tmp_path / "b" / "model-00002-of-00002.safetensors"))
    a, b = layer_digests(tmp_path / "a"), layer_digests(tmp_path / "b")
    assert set(a) == set(b) == {"-1", "0", "1", "10"}
    assert [k for k in a if a[k] != b[k]] == ["1"]


def test_determinism_smoke(tmp_path: Path) -> None:
    """Two CPU runs of the tiny model: every layer has all four records, and nothing differs (the CPU path is
    deterministic)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "determinism.py"), "--out", str(tmp_path / "out")]
    cmd += ["--preset", "tiny", "--long", "300", "--short", "64", "--short-count", "2", "--runs", "2"]
    cmd += ["--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "determinism-gptq.json").read_text())
    layers = preset_config("tiny")["num_hidden_layers"]
    assert res["first_difference"] == [{"inputs": None, "weights": None, "stats": None, "export": None}]
    for run in res["runs"]:
        assert list(run["layers"]) == [str(i) for i in range(layers)]
        for entry in run["layers"].values():
            assert set(entry) == {"inputs", "weights", "stats", "export"}
            assert {"mlp_in", "mlp_out"} <= set(entry["stats"])
    first = res["runs"][0]["layers"]
    assert len({entry["inputs"] for entry in first.values()}) == layers  # each layer reads other hidden states


def test_checksums_see_one_bit_and_first_difference_names_the_layer() -> None:
    import torch

    det = _benchmark("determinism")
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[2, 4] ^= 1  # one ulp of one value
    assert det.bit_checksum(x) != det.bit_checksum(y)
    z = torch.zeros(4)
    assert det.bit_checksum(z) != det.bit_checksum(-z)  # -0.0 == 0.0 as values, not as bits
    assert det.hidden_checksum([x, x]) != det.hidden_checksum([x, y])
    run = {"layers": {str(i): {"inputs": i, "weights": 0, "stats": {"g": i}, "export": f"e{i}"} for i in range(4)}}
    later = json.loads(json.dumps(run))
    later["layers"]["2"]["stats"] = {"g": -1}  # the statistics of layer 2 part, then everything after them
    for i in (2, 3):
        later["layers"][str(i)]["export"] = "other"
    later["layers"]["3"]["inputs"] = -3
    assert det.first_difference([run, run, later]) == [
        {"inputs": None, "weights": None, "stats": None, "export": None},
        {"inputs": 3, "weights": None, "stats": 2, "export": 2},
    ]
