"""The model definition on a GPU: a tiny random checkpoint on CUDA against the CPU in every attention mode, cached
decode against the full forward, bf16 against fp32, and transformers' ``AutoModelForCausalLM.generate`` against the
model's own greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from salaquant.model.loading import load_model

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``b``."""
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def models(tiny_ckpt_fp32: Path) -> dict[str, object]:
    return {
        "gpu": load_model(tiny_ckpt_fp32, device="cuda", dtype="fp32"),
        "cpu": load_model(tiny_ckpt_fp32, device="cpu", dtype="fp32"),
        "bf16": load_model(tiny_ckpt_fp32, device="cuda"),
    }


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gpu_matches_cpu_and_cached_decode_matches_full(models: dict, mode: str) -> None:
    """600 tokens (past the tiny config's dense_len, so "sparse" drops blocks): the GPU forward equals the CPU one
    up to fp32 summation order, and 500 prefilled tokens plus 100 cached decode steps equal the full forward."""
    m32, c32 = models["gpu"], models["cpu"]
    ids = torch.randint(0, 264, (2, 600), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        full = m32(ids, attention_mode=mode).logits
        gpu_cpu = _rel(full, c32(ids.cpu(), attention_mode=mode).logits)
        cache = m32.new_cache()
        parts = [m32(ids[:, :500], cache=cache, attention_mode=mode).logits]
        for t in range(500, 600):
            parts.append(m32(ids[:, t : t + 1], cache=cache, attention_mode=mode).logits)
    decode_full = _rel(torch.cat(parts, 1), full)
    assert gpu_cpu < 1e-4 and decode_full < 1e-4, (gpu_cpu, decode_full)


def test_gpu_bf16_close_to_fp32(models: dict) -> None:
    ids = torch.randint(0, 264, (2, 600), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        bf16 = models["bf16"](ids, attention_mode="auto").logits
        fp32 = models["gpu"](ids).logits
    rel = _rel(bf16, fp32)
    assert rel < 5e-2, rel


def test_gpu_transformers_generate_equals_greedy(models: dict, tiny_ckpt_fp32: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import salaquant.model.hf  # noqa: F401  (registers the architecture with transformers)

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt_fp32, dtype=torch.float32).to("cuda")
    tok = AutoTokenizer.from_pretrained(tiny_ckpt_fp32)
    enc = tok("The quick brown fox", return_tensors="pt").to("cuda")
    with torch.no_grad():
        gen = hf.generate(**enc, max_new_tokens=16, do_sample=False)
        ours = models["gpu"].greedy(enc.input_ids, 16)
    assert torch.equal(gen, ours)
