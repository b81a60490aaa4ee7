"""The FP8 KV cache (``salaquant.model.kv_cache_dtype``): hand-computed FP8 values, every path of the minicpm4
attention reading the stored keys, and ``salaquant eval --kv-cache``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.eval import EvalInputError, EvalOptions, run_eval
from salaquant.model.kv_cache_dtype import stored, use_kv_cache_dtype
from salaquant.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"


def test_stored_values_by_hand() -> None:
    x = torch.tensor([1.0, 300.0, -0.3, 1.0625], dtype=torch.bfloat16)
    # e4m3: 3 mantissa bits, steps of 32 in [256, 512) and 1/32 in [0.25, 0.5); e5m2: 2 bits, steps of 64 and 1/16
    assert stored(x, "fp8_e4m3").tolist() == [1.0, 288.0, -0.3125, 1.0]
    assert stored(x, "fp8_e5m2").tolist() == [1.0, 320.0, -0.3125, 1.0]
    assert torch.equal(stored(x, "bf16"), x)
    assert stored(x, "fp8_e4m3", scale=2.0).tolist() == [1.0, 288.0, -0.3125, 1.0]  # x / 2 -> fp8 -> * 2
    with pytest.raises(ValueError, match="KV cache dtype"):
        stored(x, "int8")


def test_every_attention_path_reads_the_stored_keys() -> None:
    """With an FP8 cache the model's logits equal those of a model whose k/v projections round their outputs the
    same way, in a dense window, with the cache and in the sparse mode; and they differ from the bf16 cache's."""
    model = load_model(MODEL)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        use_kv_cache_dtype(model, "fp8_e4m3")
        fp8 = {mode: model(ids, attention_mode=mode).logits for mode in ("dense", "sparse")}
        cached = model.generate(ids[:, :200], 8)
        use_kv_cache_dtype(model, "bf16")
        hooks = [
            layer.self_attn.k_proj.register_forward_hook(lambda _m, _i, out: stored(out, "fp8_e4m3"))
            for layer in model.model.layers
            if layer.kind != "lightning"
        ] + [
            layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: stored(out, "fp8_e4m3"))
            for layer in model.model.layers
            if layer.kind != "lightning"
        ]
        assert model.config.attn_use_rope is False  # so rounding the projection is rounding what is stored
        hooked = {mode: model(ids, attention_mode=mode).logits for mode in ("dense", "sparse")}
        hooked_cached = model.generate(ids[:, :200], 8)
        for h in hooks:
            h.remove()
    for mode in ("dense", "sparse"):
        assert torch.equal(fp8[mode], hooked[mode]), mode
    assert torch.equal(cached, hooked_cached)
    assert not torch.equal(fp8["dense"], plain)


def test_eval_applies_it_to_the_export_only(shipped_rtn_export: Path, tmp_path: Path) -> None:
    base = {"max_len": 256, "windows": 1, "niah_lengths": [], "gen_tokens": 0, "layer_windows": 0, "device": "cpu",
            "show_progress": False}  # fmt: skip
    quiet = Console(quiet=True)
    bf16 = run_eval(shipped_rtn_export, MODEL, EvalOptions(**base), None, tmp_path / "a", quiet)
    e5m2 = run_eval(shipped_rtn_export, MODEL, EvalOptions(**base, kv_cache="fp8_e5m2"), None, tmp_path / "b", quiet)
    assert e5m2["quantized"]["kv_cache"] == "fp8_e5m2" and bf16["quantized"]["kv_cache"] == "bf16"
    assert e5m2["perplexity"]["ppl_source"] == bf16["perplexity"]["ppl_source"]  # the source keeps its cache
    assert e5m2["perplexity"]["kl"] != bf16["perplexity"]["kl"]
    with pytest.raises(EvalInputError, match="--kv-cache"):
        run_eval(shipped_rtn_export, MODEL, EvalOptions(**base, kv_cache="fp8"), None, tmp_path / "c", quiet)


def test_eval_scores_an_fp8_cache_of_the_bf16_model_alone(tmp_path: Path) -> None:
    base = {"max_len": 256, "windows": 1, "niah_lengths": [], "gen_tokens": 0, "layer_windows": 0, "device": "cpu",
            "show_progress": False}  # fmt: skip
    quiet = Console(quiet=True)
    res = run_eval(MODEL, MODEL, EvalOptions(**base, kv_cache="fp8_e4m3"), None, tmp_path / "a", quiet)
    assert res["quantized"]["format"] == "bf16" and res["quantized"]["check"]["status"] == "not run"
    assert res["perplexity"]["kl"] > 0  # the same weights: only the stored keys and values differ
    assert res["perplexity"]["ppl_source"] != res["perplexity"]["ppl_quantized"]
