"""The CUDA-graph decode step on a GPU (bf16, GPTQ W4A16 and NVFP4 weight-only and W4A4, with the Triton kernels;
rows crossing dense_len, a batch that is not a bucket size): replaying the captured graph of the plain step gives
the tokens of the same step run eagerly, a second call reuses the graph; the compiled step (``compile=True``) gives the
eager step's logits from the same mid-generation state (its next token the eager one's unless the two are a near-tie
within the logits' difference), and its graph replays exactly what it computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import small_nvfp4_export

from salaquant.model.static_cache import StaticCache, StaticLightningCache
from salaquant.runtime.decode import Decoder
from salaquant.runtime.load import load

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvfp4_export(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_nvfp4_export(fp32_model, tmp_path_factory.mktemp("nvfp4") / "out")


@pytest.mark.parametrize("case", ["bf16", "gptq", "nvfp4", "nvfp4-w4a4"])
def test_graph_replay_equals_eager(case: str, fp32_model: Path, shipped_rtn_export: Path, nvfp4_export: Path) -> None:
    path = {"bf16": fp32_model, "gptq": shipped_rtn_export}.get(case, nvfp4_export)
    model = load(path, device="cuda", activations="fp4" if case.endswith("w4a4") else "bf16")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (250, 40, 300)]
    for mode in ("auto", "dense"):
        eager = Decoder(model, graphs=False, attention_mode=mode).generate(prompts, 48)
        dec = Decoder(model, attention_mode=mode)
        graphed = dec.generate(prompts, 48)
        assert dec.timings.capture > 0
        again = dec.generate(prompts, 48)
        assert dec.timings.capture == 0.0  # reused
        for e, r, a in zip(eager, graphed, again, strict=True):
            assert torch.equal(e, r) and torch.equal(r, a), (case, mode)


def _buffers(cache: StaticCache) -> list[torch.Tensor]:
    """Every tensor of the decode state, in one order."""
    out = [cache.lengths]
    for entry in cache.layers:
        if isinstance(entry, StaticLightningCache):
            out.append(entry.state)
        else:
            out += [t for t in (entry.k, entry.v, entry.k1, entry.k2) if t is not None]
    return out


def _snapshot(cache: StaticCache) -> list[torch.Tensor]:
    return [t.clone() for t in _buffers(cache)]


def _restore(cache: StaticCache, saved: list[torch.Tensor]) -> None:
    for dst, src in zip(_buffers(cache), saved, strict=True):
        dst.copy_(src)


def _rounding_sensitivity(dec: Decoder, state, saved: list[torch.Tensor]) -> float:
    """How far the eager step's logits move when 30% of every RMSNorm output moves by one bf16 step (2**-8
    relative): the rounding differences a compiled norm may make. With FP4 activations such changes cross FP4
    rounding boundaries, and the tiny model's logits then move by several percent (7-10% on the CPU, the largest of
    three draws), where weight-only exports move by under 1%."""
    from salaquant.model import layers

    base = dec._step(state).clone()
    _restore(state.cache, saved)
    plain = layers.rms_norm

    def noisy(x: torch.Tensor, w: torch.Tensor, eps: float, backend: str = "reference") -> torch.Tensor:
        y = plain(x, w, eps, backend)
        step = torch.where(torch.rand_like(y, dtype=torch.float32) < 0.5, 2.0**-8, -(2.0**-8))
        moved = torch.rand_like(y, dtype=torch.float32) < 0.3
        return torch.where(moved, y.float() * (1 + step), y.float()).to(y.dtype)

    worst = 0.0
    try:
        layers.rms_norm = noisy
        for _ in range(3):
            got = dec._step(state)
            _restore(state.cache, saved)
            worst = max(worst, float((got[:3] - base[:3]).norm() / base[:3].norm()))
    finally:
        layers.rms_norm = plain
    return worst


@pytest.mark.parametrize("case", ["bf16", "gptq", "nvfp4", "nvfp4-w4a4"])
def test_compiled_step_matches_eager(case: str, fp32_model: Path, shipped_rtn_export: Path, nvfp4_export: Path) -> None:
    path = {"bf16": fp32_model, "gptq": shipped_rtn_export}.get(case, nvfp4_export)
    model = load(path, device="cuda", activations="fp4" if case.endswith("w4a4") else "bf16")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (250, 40, 300)]
    dec = Decoder(model, compile=True)
    dec.generate(prompts, 20)  # prefill, compile, capture, 19 steps: rows now past dense_len (256)
    state = dec._captured[(4, "auto")]
    assert state.graph is not None and int(state.cache.lengths[:3].min()) > 50  # row 3 is the bucket's dummy
    state.tokens.copy_(torch.tensor([[3], [5], [7], [11]], device="cuda"))
    saved = _snapshot(state.cache)
    compiled = dec.step_fn()(state).clone()
    after_compiled = _snapshot(state.cache)
    _restore(state.cache, saved)
    eager = dec._step(state).clone()
    after_eager = _snapshot(state.cache)
    _restore(state.cache, saved)
    state.graph.replay()
    assert state.logits is not None and torch.equal(state.logits[:3], compiled[:3])
    _restore(state.cache, saved)  # the replay wrote a position: the buffers hold one more step than this
    rel = (compiled[:3] - eager[:3]).norm() / eager[:3].norm()
    tol = 2e-2
    if case.endswith("w4a4"):
        tol = max(tol, 2 * _rounding_sensitivity(dec, state, saved))
    assert rel < tol, (case, float(rel), tol)
    if case.endswith("w4a4"):  # a rounding-level change may swap the tiny model's two best tokens there
        top5 = eager[:3].topk(5, dim=-1).indices
        assert (top5 == compiled[:3].argmax(-1)[:, None]).any(-1).all(), case
    else:  # the same next token, or one whose eager logit ties the best within the two steps' difference
        picked = eager[:3].gather(-1, compiled[:3].argmax(-1, keepdim=True))[:, 0]
        margin = eager[:3].amax(-1) - picked
        assert (margin <= 2 * (compiled[:3] - eager[:3]).abs().amax(-1)).all(), (case, margin.tolist(), float(rel))
    for a, b in zip(after_compiled, after_eager, strict=True):  # the same state written
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).norm() <= tol * b.float().norm() + 1e-6  # the logits' bound
