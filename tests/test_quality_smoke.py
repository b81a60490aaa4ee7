"""``benchmarks/quality.py --smoke``: every variant runs (or records why not) and lands in one table and JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_modelopt_cpu_emulation_is_modelopt_numerics() -> None:
    """The CPU route of ModelOpt's NVFP4 fake-quant op gives its NVFP4QTensor round trip exactly."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality
    finally:
        sys.path.pop(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quality._modelopt_on_cpu()
        import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    w = torch.randn(32, 64) * torch.exp(torch.randn(32, 64))
    amax = w.abs().amax()
    out = tq.dynamic_block_quant(w, 16, amax, None, (2, 1), (4, 3), None, None, True)
    q, scale, s2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=amax / (6.0 * 448.0))
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(out, ref)
    assert 0 < float((out - w).norm() / w.norm()) < 0.2  # it did quantize


def test_quality_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "quality.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["bf16"]["kl"] < 1e-9 and rows["bf16"]["top1"] == 1.0
    scored = [r for r in result["rows"] if r["tool"] in ("salaquant", "ModelOpt")]
    # ModelOpt's GPTQ and Four-Over-Six calibrate on CUDA only: 2 methods x 2 exclusions x weight-only / W4A4
    cuda_only = [r for r in scored if r["variant"].startswith(("ModelOpt NVFP4 GPTQ", "ModelOpt NVFP4 Four-Over-Six"))]
    assert len(cuda_only) == 8
    if not torch.cuda.is_available():
        assert all("needs a CUDA GPU" in r["error"] for r in cuda_only), cuda_only
        scored = [r for r in scored if r not in cuda_only]
    # 10 salaquant exports, 4 of them also W4A4 (nearest and GPTQ rounding); ModelOpt 2 x 2 weight-only, 2 x 2 W4A4
    assert len(scored) == (22 if not torch.cuda.is_available() else 30)
    for r in scored:
        assert "error" not in r, r
    # Yardsticks from the same run: 4-bit round-to-nearest on the random tiny model costs KL ~1e-3 (measured
    # 0.0011, top-1 84%); every 4-bit export, weight-only or W4A4, lands within 3x of it (measured 0.0006-0.0014),
    # where a wrong scale, zero point or code order costs 10x or more; GPTQ's error feedback beats RTN.
    rtn = rows["RTN W4 g128 (baseline)"]
    assert 0 < rtn["kl"] < 0.005 and rtn["top1"] > 0.7, rtn
    for r in scored:
        assert math.isfinite(r["ppl"]) and 0 < r["kl"] < 3 * rtn["kl"] and 0.7 < r["top1"] < 1, r
    assert rows["salaquant GPTQ W4A16 (MSE scales, default)"]["kl"] < rtn["kl"]
    for r in scored:
        if r["tool"] == "ModelOpt":
            assert r["same_linears_as_salaquant"], r
    # dense-all quantizes more linears than the default exclusions
    assert (
        rows["ModelOpt NVFP4 default, dense-all exclusions"]["quantized_linears"]
        > rows["ModelOpt NVFP4 default, default exclusions"]["quantized_linears"]
    )
    peers = [r for r in result["rows"] if r["tool"] in ("llm-compressor", "GPTQModel")]
    assert len(peers) == 7 and all("not run" in r["error"] and "setup_" in r["error"] for r in peers)
    assert any(line.startswith("GPTQ ppl increase") for line in result["targets"])
    assert "ModelOpt NVFP4 AWQ-lite, default exclusions" in proc.stdout
    for exclusions in ("default", "dense-all"):
        for cfg, name in (("default", "NVFP4_DEFAULT_CFG"), ("AWQ-lite", "NVFP4_AWQ_LITE_CFG")):
            row = rows[f"ModelOpt NVFP4 {cfg}, {exclusions} exclusions, W4A4"]
            assert row["config"] == name and row["input_quantizers"].endswith("on (W4A4)")
            assert int(row["input_quantizers"].split()[0]) == row["quantized_linears"]
            weight_only = rows[f"ModelOpt NVFP4 {cfg}, {exclusions} exclusions"]
            assert weight_only["input_quantizers"] == "off (weight-only)"
        # FP4 activations add error on top of the same weights
        assert (
            rows[f"salaquant NVFP4 {exclusions} (search), W4A4"]["kl"]
            > rows[f"salaquant NVFP4 {exclusions} (search)"]["kl"]
        )
    assert sum(line.startswith("NVFP4 W4A4") for line in result["targets"]) == 4
    # GPTQ-rounded NVFP4 (2 exclusions x weight-only / W4A4) against each ModelOpt row of its kind that ran
    gptq_lines = [line for line in result["targets"] if ", GPTQ rounding" in line.split(" vs ")[0]]
    assert len(gptq_lines) == 2 * 2 * (2 if not torch.cuda.is_available() else 4), gptq_lines
