"""``salaquant demo --quick`` end to end: its table comes from the run, and agrees with an independent scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from salaquant.cli import app
from salaquant.demo import QUICK, SHIPPED_MODEL, run_demo
from salaquant.eval.data import load_eval_text
from salaquant.eval.perplexity import compare_models, windows
from salaquant.model.loading import load_model
from salaquant.outputs import OutputError
from salaquant.workflow import load_tokenizer


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("demo")
    console = Console(record=True, width=160)
    result = run_demo(out, console, quick=True, show_progress=False)
    return out, result, console.export_text()


def test_demo_quantizes_scores_and_writes(demo_run: tuple[Path, dict, str]) -> None:
    out, result, text = demo_run
    assert json.loads((out / "demo.json").read_text()) == result
    names = [r["variant"] for r in result["rows"]]
    assert names == [
        "bf16",
        "GPTQ W4A16",
        "NVFP4 W4A4",
        "NVFP4 weight-only",
        "NVFP4 dense-all W4A4",
        "NVFP4 dense-all weight-only",
    ]
    by_name = {r["variant"]: r for r in result["rows"]}
    for export in ("NVFP4", "NVFP4 dense-all"):  # one export, scored both ways: the FP4 activations add error
        w4a4, weight_only = by_name[f"{export} W4A4"], by_name[f"{export} weight-only"]
        assert w4a4["path"] == weight_only["path"] and w4a4["activations"] == "fp4"
        assert w4a4["kl"] > weight_only["kl"]
    base = result["rows"][0]
    assert base["ppl_increase"] == 0 and base["kl"] < 1e-9 and base["top1"] == 1.0
    for row in result["rows"][1:]:
        path = Path(row["path"])
        assert (path / "config.json").exists() and row["bytes"] < 0.6 * base["bytes"], row
        assert 0 < row["ppl_increase"] < 0.10 and 0 < row["kl"] < 0.1 and row["top1"] > 0.8, row
        assert row["collapse"] == [], row
        # every number printed is the run's own
        assert f"{row['ppl']:.3f}" in text and f"{100 * row['ppl_increase']:+.2f}%" in text


def test_demo_numbers_match_the_dequantizing_loader(demo_run: tuple[Path, dict, str]) -> None:
    """The runtime (packed modules) and ``load_model`` (weights dequantized once) must score an export alike."""
    _, result, _ = demo_run
    tok = load_tokenizer(SHIPPED_MODEL)
    wins = windows(load_eval_text(None, tok, tok.eos_token_id).tokens, QUICK.eval_len, QUICK.eval_windows)
    reference = load_model(SHIPPED_MODEL)
    row = result["rows"][1]
    with torch.no_grad():
        independent = compare_models(reference, load_model(row["path"]), wins)
    assert independent["ppl"] == pytest.approx(row["ppl"], rel=2e-3)
    assert independent["kl"] == pytest.approx(row["kl"], rel=0.05, abs=1e-4)


def test_demo_refuses_a_foreign_folder_and_missing_inputs(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(OutputError, match=r"holds files salaquant did not write \(mine.txt\)"):
        run_demo(tmp_path, Console(), quick=True, show_progress=False)
    assert (tmp_path / "mine.txt").read_text() == "keep"
    res = CliRunner().invoke(app, ["demo", "--quick", "-o", str(tmp_path / "d"), "--model", str(tmp_path / "none")])
    assert res.exit_code == 2 and "--model" in res.output
