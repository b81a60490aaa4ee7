"""The command line: tiny checkpoints and inspect."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from salaquant.cli import app
from salaquant.model.config import SalaConfig
from salaquant.model.tiny import preset_config
from salaquant.summary import summarize

runner = CliRunner()


def test_tiny_then_inspect(tmp_path: Path) -> None:
    out = tmp_path / "t"
    res = runner.invoke(app, ["tiny", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "minicpm4" in res.output and "lightning" in res.output
    assert "tensors present with the expected shapes" in res.output


def test_tiny_is_deterministic_and_refuses_overwrite(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert runner.invoke(app, ["tiny", str(a), "--seed", "5"]).exit_code == 0
    assert runner.invoke(app, ["tiny", str(b), "--seed", "5"]).exit_code == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    res = runner.invoke(app, ["tiny", str(a)])
    assert res.exit_code != 0
    assert runner.invoke(app, ["tiny", str(a), "--overwrite", "--seed", "6"]).exit_code == 0
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_inspect_rejects_non_sala(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    res = runner.invoke(app, ["inspect", str(tmp_path)])
    assert res.exit_code == 2
    assert "model_type" in res.output


def test_inspect_reports_missing_tensor(tmp_path: Path) -> None:
    out = tmp_path / "t"
    assert runner.invoke(app, ["tiny", str(out)]).exit_code == 0
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    del state["model.layers.1.self_attn.o_norm.weight"]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 2
    assert "model.layers.1.self_attn.o_norm.weight" in res.output


def test_full_shape_parameter_count_and_sizes() -> None:
    """The real shape totals 9.477B parameters (published as ~9.48B; bf16 checkpoint ~18.95 GB)."""
    s = summarize(SalaConfig.from_dict(preset_config("full")))
    assert round(s.total_params / 1e9, 3) == 9.477
    assert abs(s.sizes["bf16"] / 1e9 - 18.95) < 0.01
    # hand count: 8 sparse layers x (q 4096^2 + k,v 256x4096 + o 4096^2 + o_gate 4096^2)
    assert s.kinds["minicpm4"].attention == 8 * (3 * 4096 * 4096 + 2 * 256 * 4096)
    assert s.kinds["lightning"].attention == 24 * 5 * 4096 * 4096
    assert s.kinds["lightning"].mlp == 24 * 3 * 4096 * 16384
    # W4A16: a 4096x4096 linear is 8 MiB of int4 + 32 groups x 4096 fp16 scales + qzeros + g_idx
    assert s.sizes["w4a16"] < 0.33 * s.sizes["bf16"]
    assert s.sizes["nvfp4_dense_all"] < s.sizes["nvfp4_default"] < s.sizes["bf16"]


SHIPPED = Path(__file__).resolve().parents[1] / "models" / "sala-tiny"
CALIB = Path(__file__).resolve().parents[1] / "calib" / "sala-tiny-calib.jsonl"


def test_calibrate_writes_statistics(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    args = [
        "calibrate",
        "-i",
        str(SHIPPED),
        "-o",
        str(out),
        "--calib",
        str(CALIB),
        "--max-samples",
        "2",
        "--max-len",
        "300",
        "--device",
        "cpu",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "calibration.json").read_text())
    assert report["calibration"]["samples"] == 2 and report["tokens"] == 600
    assert len(report["layers"]) == 8 and (out / "layers" / "007.safetensors").exists()
    assert not (tmp_path / "stats.work").exists()
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_calibrate_no_bos_drops_one_token_per_sample(tmp_path: Path) -> None:
    """``--no-bos`` calibrates on the records' own tokens (a model trained without BOS); the default adds one BOS
    per sample. Token counts against the tokenizer run directly on the first two records."""
    from salaquant.workflow import load_tokenizer

    tok = load_tokenizer(SHIPPED)
    records = sorted(CALIB.read_text().splitlines(), key=len)[:2]  # the two shortest, for a short run
    calib = tmp_path / "short.jsonl"
    calib.write_text("\n".join(records) + "\n")
    texts = [json.loads(line)["text"] for line in records]
    own = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    for flag, expected in (("--bos", own + 2), ("--no-bos", own)):
        out = tmp_path / flag
        args = ["calibrate", "-i", str(SHIPPED), "-o", str(out), "--calib", str(calib), "--max-samples", "2"]
        res = runner.invoke(app, [*args, "--device", "cpu", flag])
        assert res.exit_code == 0, res.output
        report = json.loads((out / "calibration.json").read_text())
        assert report["tokens"] == expected, (flag, report["tokens"], own)


def test_calibrate_bad_inputs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    res = runner.invoke(app, ["calibrate", "-i", str(SHIPPED), "-o", str(tmp_path / "o"), "--calib", str(bad)])
    assert res.exit_code == 2 and "bad.jsonl:2" in res.output
    res = runner.invoke(
        app, ["calibrate", "-i", str(SHIPPED), "-o", str(tmp_path / "o"), "--calib", str(CALIB), "--resume"]
    )
    assert res.exit_code == 2 and "no work folder" in res.output
