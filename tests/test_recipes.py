"""YAML recipes and `salaquant run`: shipped recipes run, flags == recipe bytes, bad recipes are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from salaquant.cli import app
from salaquant.recipe import RecipeError, load_recipe, shipped_recipes
from salaquant.settings import SMOOTH_BY_DEFAULT, SMOOTH_GROUPS, defaults

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "sala-tiny")
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
HELDOUT = str(ROOT / "models" / "sala-tiny" / "heldout.jsonl")
SMALL = [
    "--set",
    "calibration.max_samples=2",
    "--set",
    "calibration.max_len=128",
    "--set",
    "engine.device=cpu",
]
QUICK_NVFP4 = ["--set", "nvfp4.mse_iters=4"]  # only for nvfp4 recipes: the others refuse nvfp4 settings
runner = CliRunner()


def _files(folder: Path) -> dict[str, bytes]:
    """Every output file except the two that record timings (report and log)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in ("quant_report.json", "quantize.log")}


def test_shipped_recipes_listed_and_valid() -> None:
    names = set(shipped_recipes())
    assert names == {"gptq-w4a16", "nvfp4", "nvfp4-dense-all", "gptq-w4-mlp-w8-attn", "rtn-w4a16"}
    for name in names:
        r = load_recipe(name)
        assert r.description
    res = runner.invoke(app, ["recipes"])
    assert res.exit_code == 0 and all(n in res.output for n in names)


@pytest.mark.parametrize(("name", "method"), [("gptq-w4a16", "gptq"), ("nvfp4", "nvfp4")])
def test_default_recipes_are_the_defaults(name: str, method: str) -> None:
    """The recipes named for a method alone run exactly what its flags run by default."""
    got = load_recipe(name).model_dump(mode="json")
    want = defaults(method).model_dump(mode="json")
    got.pop("description"), want.pop("description")
    assert got["smoothing"].pop("enabled") in (None, SMOOTH_BY_DEFAULT[method])
    want["smoothing"].pop("enabled")
    assert got["smoothing"].pop("groups") in (None, list(SMOOTH_GROUPS[method]))
    want["smoothing"].pop("groups")
    assert got["export"].pop("checkpoint_format") == ("modelopt" if method == "nvfp4" else "gptq")
    want["export"].pop("checkpoint_format")
    assert got == want


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipe_runs(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    small = SMALL + (QUICK_NVFP4 if name.startswith("nvfp4") else [])
    res = runner.invoke(app, ["run", name, "-i", MODEL, "-o", str(out), "--calib", CALIB, *small])
    assert res.exit_code == 0, res.output
    assert load_recipe(out / "recipe.yaml") == load_recipe(name, [*small[1::2], f"calibration.sources=[{CALIB}]"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == ("modelopt" if name.startswith("nvfp4") else "gptq")
    if name == "gptq-w4-mlp-w8-attn":
        from salaquant.formats.gptq_v1.dynamic import plan_for

        def bits(module: str) -> int | None:
            return plan_for(qc.get("dynamic", {}), module, qc["bits"], qc["group_size"]).bits

        assert bits("model.layers.3.mlp.gate_up_proj") == bits("model.layers.3.mlp.down_proj") == 4
        assert bits("model.layers.3.self_attn.qkv_proj") == bits("model.layers.3.self_attn.z_proj") == 8


@pytest.mark.parametrize(
    "flags",
    [
        ["gptq", "--layer-bits", "7:8", "--damp", "0.02", "--exclude", r"layers\.3\.mlp"],
        ["nvfp4", "--dense-all", "--mse-iters", "3", "--smooth-alpha", "0.4"],
    ],
)
def test_flags_and_saved_recipe_give_identical_bytes(flags: list[str], tmp_path: Path) -> None:
    common = ["-i", MODEL, "--calib", CALIB, "--max-samples", "2", "--max-len", "128", "--device", "cpu"]
    rec = tmp_path / "r.yaml"
    res = runner.invoke(app, [flags[0], *common, "-o", str(tmp_path / "a"), *flags[1:], "--save-recipe", str(rec)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(rec), "-i", MODEL, "-o", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and "recipe.yaml" in a
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


def _bad(tmp_path: Path, text: str, *extra: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    res = runner.invoke(app, ["run", str(path), "-i", MODEL, "-o", str(tmp_path / "o"), "--calib", CALIB, *extra])
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "o").exists()
    return " ".join(res.output.split())


def test_bad_recipes_name_file_line_and_key(tmp_path: Path) -> None:
    out = _bad(tmp_path, "method: gptq\ngptq:\n  dmap: 0.05\n")
    assert "bad.yaml:3" in out and "gptq.dmap" in out and "did you mean 'gptq.damp'" in out
    out = _bad(tmp_path, "method: gptq\ncalibration:\n  max_len: lots\n")
    assert "bad.yaml:3" in out and "calibration.max_len" in out and "integer" in out
    out = _bad(tmp_path, "method: nvfp4\nnvfp4:\n  mse_max_shrink: 1.5\n")
    assert "bad.yaml:3" in out and "nvfp4.mse_max_shrink" in out and "expected a number in [0.0, 1.0)" in out
    out = _bad(tmp_path, "method: gptq\nquantization:\n  bits: 3\n")
    assert "quantization.bits" in out
    out = _bad(tmp_path, "method: awq\n")
    assert "bad.yaml:1" in out and "method" in out
    out = _bad(
        tmp_path,
        "method: gptq\nquantization:\n  rules:\n    - match: 'layers\\.2\\.self_attn\\.k_proj'\n      bits: 8\n",
    )
    assert "bad.yaml:4" in out and "rules[0]" in out and "split the fused" in out
    out = _bad(tmp_path, "method: gptq\nquantization:\n  rules:\n    - match: '(oops'\n")
    assert "bad.yaml:4" in out and "regular expression" in out
    out = _bad(tmp_path, "method: nvfp4\nsmoothing:\n  groups: [mlp_out]\n")
    assert "bad.yaml:3" in out and "smoothing.groups[0]" in out and "'mlp_out' is not a nvfp4 smoothing group" in out
    out = _bad(tmp_path, "method: gptq\n  bad: [indent\n")
    assert "not valid YAML" in out
    out = _bad(tmp_path, "method: gptq\n", "--set", "gptqdamp")
    assert "KEY=VALUE" in out
    out = _bad(tmp_path, "method: gptq\n", "--set", "gptq.damp=-1")
    # the error blames the --set argument, not a line of the recipe
    assert "--set gptq.damp=-1: gptq.damp: expected a number in (0.0, 1.0]" in out and "bad.yaml" not in out


def test_unknown_shipped_name_suggests() -> None:
    with pytest.raises(RecipeError, match="did you mean 'rtn-w4a16'"):
        load_recipe("rtn-w4a61")


def test_empty_sources_refused_before_work(tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", "rtn-w4a16", "-i", MODEL, "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "calibration.sources" in res.output


def test_eval_gate_sets_exit_code(tmp_path: Path) -> None:
    gate = ["--set", f"eval.data={HELDOUT}", "--set", "eval.seq_len=256", "--set", "eval.windows=2"]

    def gated(out: str, *extra: str) -> Result:
        """``run rtn-w4a16`` into ``tmp_path / out`` with the small calibration, the gate and ``extra``."""
        args = ["run", "rtn-w4a16", "-i", MODEL, "-o", str(tmp_path / out), "--calib", CALIB, *SMALL, *gate]
        return runner.invoke(app, [*args, *extra])

    ok = gated("ok", "--set", "eval.max_ppl_increase=0.5")
    assert ok.exit_code == 0, ok.output
    result = json.loads((tmp_path / "ok" / "eval_gate.json").read_text())
    assert result["passed"] and result["kl"] > 0 and result["ppl_quantized"] > 0
    bad = gated("bad", "--set", "eval.max_kl=0.0")
    assert bad.exit_code == 3 and "eval gate failed" in bad.output and "KL" in bad.output
    # the failed export is kept only under a name that says so; -o is not written
    out = " ".join(bad.output.split())
    assert f"kept at {tmp_path / 'bad.gate-failed'}" in out and "was not written" in out
    assert not (tmp_path / "bad").exists()
    assert not json.loads((tmp_path / "bad.gate-failed" / "eval_gate.json").read_text())["passed"]
    # a failed gate over an existing good export leaves that export as it was
    before = (tmp_path / "ok" / "model.safetensors").read_bytes()
    again = gated("ok", "--set", "eval.max_kl=0.0", "--set", "calibration.seed=1", "--overwrite")
    assert again.exit_code == 3, again.output
    assert json.loads((tmp_path / "ok" / "eval_gate.json").read_text())["passed"]
    assert (tmp_path / "ok" / "model.safetensors").read_bytes() == before


def test_recipe_calibration_reaches_the_loader(tmp_path: Path) -> None:
    """Every calibration key of a recipe lands in the loader's options (``bos`` included), none dropped."""
    from salaquant.run_recipe import calib_options

    path = tmp_path / "r.yaml"
    path.write_text("method: gptq\ncalibration:\n  max_samples: 7\n  max_len: 333\n  min_len: 2\n  bos: false\n")
    opts = calib_options(load_recipe(path, ["calibration.shuffle=true", "calibration.seed=5"]))
    assert (opts.max_samples, opts.max_len, opts.min_len, opts.shuffle, opts.seed, opts.bos) == (
        7,
        333,
        2,
        True,
        5,
        False,
    )
    assert calib_options(load_recipe("gptq-w4a16")).bos is True
