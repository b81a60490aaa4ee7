"""Batched decoding on the static cache (CPU: the eager step a CUDA graph captures) against the model's own cached
decoding, row by row; fused projections against the three / two linears they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.model.cache import SalaCache
from salaquant.model.modeling import NonFiniteLogits
from salaquant.model.sampling import Sampling
from salaquant.model.static_cache import StaticCache
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.decode import Decoder, bucket
from salaquant.runtime.linear import GPTQLinear, NVFP4Linear
from salaquant.runtime.load import load

ROOT = Path(__file__).resolve().parents[1]
FP32 = {"dtype": "fp32", "kernels": False}


def _prompts(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def models(fp32_model: Path):
    return load(fp32_model, **FP32), load(fp32_model, **FP32, fuse=False)


@pytest.mark.parametrize("mode", ["auto", "dense", "sparse"])
def test_static_step_logits_equal_the_cached_model(models, mode: str) -> None:
    """Rows of different lengths, one static cache: each decode step's logits are the logits the model gives
    each prompt alone with its own cache, across dense_len (256 in the tiny config) and in every mode."""
    fused, plain = models
    cfg = fused.config
    prompts = _prompts((7, 250, 300), cfg.vocab_size)
    steps = 12
    static = StaticCache.allocate(cfg, len(prompts), 320, "cpu", torch.float32)
    feeds = torch.randint(0, cfg.vocab_size, (len(prompts), steps), generator=torch.Generator().manual_seed(1))
    expected = []
    for i, p in enumerate(prompts):
        dyn = SalaCache.for_config(cfg)
        plain(p[None], cache=dyn, attention_mode=mode)
        static.load_row(i, dyn, 0)
        expected.append(torch.cat([plain(feeds[i, s].view(1, 1), cache=dyn, attention_mode=mode).logits[:, -1]
                                   for s in range(steps)]))  # fmt: skip
    for s in range(steps):
        got = fused(feeds[:, s : s + 1], cache=static, attention_mode=mode).logits[:, -1]
        for i in range(len(prompts)):
            torch.testing.assert_close(got[i], expected[i][s], rtol=1e-4, atol=1e-4)
    assert static.lengths.tolist() == [len(p) + steps for p in prompts]


def test_batched_generation_equals_each_prompt_alone(models) -> None:
    """Greedy batched generation gives every prompt the tokens its own ``generate`` gives, including rows that
    cross dense_len and a batch that is not a bucket size (dummy rows dropped)."""
    fused, plain = models
    prompts = _prompts((5, 250, 31, 250, 120), fused.config.vocab_size, seed=2)
    out = Decoder(fused).generate_in_batches(prompts, 24, batch_size=3)
    assert len(out) == len(prompts)
    for p, got in zip(prompts, out, strict=True):
        assert torch.equal(got, plain.generate(p[None], 24)[0, len(p) :])


def test_each_row_stops_at_eos_and_sampling_is_reproducible(models) -> None:
    fused, plain = models
    prompts = _prompts((9, 40), fused.config.vocab_size, seed=3)
    alone = [plain.generate(p[None], 30)[0, len(p) :] for p in prompts]
    eos = int(alone[0][4])  # row 0 meets it at its 5th token at the latest; row 1 stops wherever it meets it
    out = Decoder(fused).generate(prompts, 30, eos_token_id=eos)
    for got, ref in zip(out, alone, strict=True):
        hits = (ref == eos).nonzero()
        cut = int(hits[0]) + 1 if hits.numel() else len(ref)
        assert torch.equal(got, ref[:cut])
    assert len(out[0]) <= 5
    sampling = Sampling(temperature=0.8, top_k=50)
    runs = [
        Decoder(fused).generate(prompts, 16, sampling, generator=torch.Generator().manual_seed(7)) for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_decoder_refuses_bad_prompts_and_reports_nonfinite(models, fp32_model: Path, tmp_path: Path) -> None:
    fused, _ = models
    dec = Decoder(fused)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        dec.generate([torch.zeros(0, dtype=torch.long)], 4)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        dec.generate([torch.zeros(2, 3, dtype=torch.long)], 4)
    assert dec.generate([], 4) == []
    broken = load(fp32_model, **FP32)
    broken.model.layers[2].mlp.down_proj.weight.data[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="prompt 0"):
        Decoder(broken).generate(_prompts((6,), broken.config.vocab_size), 4)
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 130)] == [1, 2, 4, 8, 16, 32, 64, 64, 128, 192]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0]


def test_fused_projections_compute_what_their_members_do(
    fp32_model: Path, shipped_rtn_export: Path, tmp_path: Path
) -> None:
    """bf16 weights, GPTQ and NVFP4 (weight-only and W4A4), run in bf16: one fused gate_up_proj per layer and one
    fused q/k/v with the output gate where the members share what a fused linear needs (else q/k/v alone), and
    exactly the logits of the unfused model (each output column is computed alone, in the same order)."""
    ids = _prompts((40,), 4096)[0]
    nvfp4 = run_method(
        fp32_model,
        tmp_path / "nvfp4",
        [str(ROOT / "calib" / "sala-tiny-calib.jsonl")],
        CalibOptions(max_samples=1, max_len=64),
        NVFP4Method(NVFP4LayerOptions(mse_iters=0), NVFP4RunOptions(device="cpu", show_progress=False)),
        Console(quiet=True),
    )
    cases = [(fp32_model, "bf16", torch.nn.Linear), (shipped_rtn_export, "bf16", GPTQLinear)]
    cases += [(nvfp4, "bf16", NVFP4Linear), (nvfp4, "fp4", NVFP4Linear)]
    for path, acts, kind in cases:
        fused = load(path, kernels=False, activations=acts)  # bf16
        plain = load(path, kernels=False, activations=acts, fuse=False)
        for layer, alone in zip(fused.model.layers, plain.model.layers, strict=True):
            assert isinstance(layer.mlp.gate_up_proj, kind) and "gate_proj" not in layer.mlp._modules
            gate = "z_proj" if layer.kind == "lightning" else "o_gate"
            members = [alone.self_attn.get_submodule(n) for n in ("q_proj", "k_proj", "v_proj", gate)]
            shared = len({_fusion_key(m) for m in members}) == 1
            want = ("qkvz_proj" if gate == "z_proj" else "qkvg_proj") if shared else "qkv_proj"
            attn = layer.self_attn
            assert attn.fused_name == want and (gate not in attn._modules) == shared
            qkv = attn.get_submodule(want)
            assert type(qkv) is type(members[0]) and sum(attn.fused_sizes) == qkv.out_features
            if kind is NVFP4Linear:
                assert (getattr(qkv, "input_scale", None) is not None) == (acts == "fp4" and layer.kind == "lightning")
        vocab_ids = ids % fused.config.vocab_size
        assert torch.equal(_logits(fused, vocab_ids), _logits(plain, vocab_ids)), (path, acts)


def _fusion_key(m: torch.nn.Module) -> tuple:
    """What linears must share to be computed as one: their kind and format settings."""
    if isinstance(m, GPTQLinear):
        return ("gptq", m.bits, m.group_size)
    if isinstance(m, NVFP4Linear):
        scale = None if m.input_scale is None else float(m.input_scale)
        return ("nvfp4", float(m.weight_scale_2), scale)
    return ("linear", m.weight.dtype)


def test_generate_command_with_a_prompts_file(fp32_model: Path, tmp_path: Path) -> None:
    """``salaquant generate --prompts FILE --batch-size 2``: one JSON line per prompt, in order, each the
    completion the single-prompt command gives."""
    import json

    from typer.testing import CliRunner

    from salaquant.cli import app

    texts = ["It is a truth universally acknowledged", "In the beginning", "The king said"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(texts) + "\n\n")
    common = ["--max-new-tokens", "10", "--device", "cpu"]
    res = CliRunner().invoke(app, ["generate", str(fp32_model), "--prompts", str(path), "--batch-size", "2", *common])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == texts
    for r in rows:
        one = CliRunner().invoke(app, ["generate", str(fp32_model), "--prompt", r["prompt"], *common])
        assert one.exit_code == 0 and one.stdout.strip().endswith(r["completion"].strip()), one.output
        assert 1 <= r["tokens"] <= 10
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    bad = CliRunner().invoke(app, ["generate", str(fp32_model), "--prompts", str(empty), *common])
    assert bad.exit_code != 0 and "no prompt in the file" in bad.output


@pytest.mark.parametrize("n", [1, 7, 130])
def test_top_blocks_is_a_stable_descending_sort(n: int) -> None:
    """The rank choice of the static selection against ``torch.sort(stable=True)``'s first k, on scores full of
    ties, forced (+inf) and unreached (-inf) blocks."""
    from salaquant.model.static_cache import top_blocks

    g = torch.Generator().manual_seed(n)
    scores = torch.randint(0, 4, (3, 2, n), generator=g).float()
    scores[torch.rand(scores.shape, generator=g) < 0.2] = float("inf")
    scores[torch.rand(scores.shape, generator=g) < 0.2] = float("-inf")
    for k in (1, 5, n, n + 3):
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        want = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
        assert torch.equal(top_blocks(scores, k), want), k


def test_selection_as_the_compiler_traces_it_equals_eager() -> None:
    """Inside ``torch.compile`` the compressed-key scores are a broadcast product (``_window_logits``): traced
    (``aot_eager``, so on any CPU) the selection is the eager one, rows before and after their first window."""
    from salaquant.model.sparse_attention import SparseParams
    from salaquant.model.static_cache import StaticSparseCache, _selected_keys

    params = SparseParams(kernel_size=16, kernel_stride=8, init_blocks=1, block_size=32, window_size=32, topk=3)
    g = torch.Generator().manual_seed(4)
    b, cap, hkv, d = 3, 320, 2, 32
    k, v = (torch.randn(b, cap, hkv, d, generator=g) for _ in range(2))
    k1, k2 = torch.randn(b, 39, hkv, d, generator=g), torch.randn(b, 19, hkv, d, generator=g)
    cache = StaticSparseCache(k, v, k1, k2, torch.tensor([300, 20, 150]))
    q = torch.randn(b, 1, hkv * 4, d, generator=g)
    eager = _selected_keys(q, cache, cache.lengths, params)
    traced = torch.compile(_selected_keys, backend="aot_eager", fullgraph=True)(q, cache, cache.lengths, params)
    assert eager.any() and torch.equal(traced, eager)
