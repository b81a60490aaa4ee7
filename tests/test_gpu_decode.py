"""The CUDA-graph decode step on a GPU: replaying the captured graph gives the tokens of the same step run eagerly
(bf16, GPTQ W4A16 and NVFP4 weight-only and W4A4, with the Triton kernels), rows crossing dense_len, a batch that
is not a bucket size, and a second call reusing the graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from salaquant.calib_data import CalibOptions
from salaquant.nvfp4.command import NVFP4RunOptions, run_nvfp4
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.decode import Decoder
from salaquant.runtime.load import load

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nvfp4_export(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_nvfp4(
        fp32_model,
        tmp_path_factory.mktemp("nvfp4") / "out",
        [str(ROOT / "calib" / "sala-tiny-calib.jsonl")],
        CalibOptions(max_samples=1, max_len=64),
        NVFP4LayerOptions(mse_iters=0),
        NVFP4RunOptions(device="cpu", show_progress=False),
        Console(quiet=True),
    )


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
