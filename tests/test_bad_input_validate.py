"""Settings and sources that used to run to a wrong answer without a word, or fail only after the calibration.

Each bad input is refused before any calibration data is read (the calibration file given is one that does not
exist: a check made later would report that file instead), with one line naming the file and line, key, flag,
pattern or tensor, and exit status 2. Safetensors headers are checked against what the safetensors library
itself accepts.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from cli_checks import SMALL, cli, one_error_line
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from shipped import CALIB

from salaquant.io.files import CheckpointError
from salaquant.io.reader import CheckpointReader
from salaquant.model.loading import check_finite, validate_source
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.recipe import load_recipe, shipped_recipes
from salaquant.settings import NOT_READ


def _refusal(res) -> str:
    """The one ``error:`` line of a refusal (exit 2, no traceback), whitespace-normalised."""
    assert res.exit_code == 2, res.output
    return " ".join(one_error_line(res).split())


@pytest.fixture()
def model(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny random checkpoint (tests damage theirs)."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))


@pytest.fixture()
def nowhere(tmp_path: Path) -> str:
    """A calibration file that does not exist: any check made after the data is read reports it instead."""
    return str(tmp_path / "no-such-calib.jsonl")


def _run(recipe: Path, model: Path, out: Path, calib: str, *extra: str):
    return cli("run", str(recipe), "-i", str(model), "-o", str(out), "--calib", calib, *extra)


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def _nothing_written(out: Path) -> None:
    parent = out.parent
    assert not out.exists() and not (parent / f"{out.name}.work").exists()
    assert not list(parent.glob(f".{out.name}.tmp-*")) and not (parent / f"{out.name}.gate-pending").exists()


# ------------------------------------------------------------------------------------- recipes


def test_eval_thresholds_without_eval_data_are_refused(model: Path, tmp_path: Path, nowhere: str) -> None:
    text = "method: rtn\neval:\n  seq_len: 256\n  max_ppl_increase: 0.05\n"
    res = _run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere)
    line = _refusal(res)
    assert f"{tmp_path / 'r.yaml'}:3: eval.seq_len" in line and "eval.data" in line, line
    assert f"{tmp_path / 'r.yaml'}:4: eval.max_ppl_increase" in res.output  # every ignored key, each on its line
    res = cli(
        "run", "rtn-w4a16", "-i", str(model), "-o", str(tmp_path / "q"), "--calib", nowhere, "--set", "eval.max_kl=0.1"
    )
    assert "--set eval.max_kl=0.1: eval.max_kl:" in _refusal(res)
    _nothing_written(tmp_path / "q")


def test_duplicate_keys_are_refused_naming_both_lines(model: Path, tmp_path: Path, nowhere: str) -> None:
    text = "method: rtn\nquantization:\n  bits: 8\n  group_size: 128\n  bits: 4\n"
    line = _refusal(_run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere))
    assert f"{tmp_path / 'r.yaml'}:5: key 'quantization.bits' is given twice (first at line 3)" in line, line
    text = "method: gptq\nquantization:\n  rules:\n    - match: mlp\n      bits: 8\n      match: self_attn\n"
    line = _refusal(_run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere))
    assert ":6: key 'quantization.rules[0].match' is given twice (first at line 4)" in line, line
    text = "method: gptq\nmethod: nvfp4\n"
    assert "r.yaml:2: key 'method' is given twice (first at line 1)" in _refusal(
        _run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere)
    )
    _nothing_written(tmp_path / "q")


@pytest.mark.parametrize(
    ("text", "where", "key"),
    [
        ("method: nvfp4\ngptq:\n  damp: 0.05\n", 3, "gptq.damp"),
        ("method: nvfp4\nquantization:\n  bits: 8\n", 3, "quantization.bits"),
        ("method: nvfp4\nquantization:\n  rules:\n    - match: mlp\n      bits: 8\n", 3, "quantization.rules"),
        ("method: nvfp4\nexport:\n  tp: 2\n", 3, "export.tp"),
        ("method: gptq\nnvfp4:\n  mse_iters: 4\n", 3, "nvfp4.mse_iters"),
        ("method: rtn\ngptq:\n  mse: false\n  damp: 0.1\n", 4, "gptq.damp"),
    ],
)
def test_settings_the_method_does_not_read_are_refused(
    text: str, where: int, key: str, model: Path, tmp_path: Path, nowhere: str
) -> None:
    line = _refusal(_run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere))
    method = text.split("\n")[0].removeprefix("method: ")
    assert f"r.yaml:{where}: {key}: method {method} does not read it" in line, line
    _nothing_written(tmp_path / "q")


def test_settings_the_method_does_not_read_are_refused_as_flags_and_overrides(
    model: Path, tmp_path: Path, nowhere: str
) -> None:
    args = ["-i", str(model), "-o", str(tmp_path / "q"), "--calib", nowhere]
    line = _refusal(cli("gptq", *args, "--method", "rtn", "--damp", "0.05"))
    assert "--damp 0.05: method rtn does not read it" in line, line
    line = _refusal(cli("run", "nvfp4", *args, "--set", "gptq.act_order=true"))
    assert "--set gptq.act_order=true: gptq.act_order: method nvfp4 does not read it" in line, line
    _nothing_written(tmp_path / "q")


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipes_round_trip_without_settings_they_do_not_read(name: str, tmp_path: Path) -> None:
    recipe = load_recipe(name, ["calibration.sources=[a.jsonl]"])
    saved = tmp_path / "saved.yaml"
    saved.write_text(recipe.to_yaml())
    assert load_recipe(saved) == recipe
    data = yaml.safe_load(saved.read_text())
    for key in NOT_READ[recipe.method]:
        section, _, sub = key.partition(".")
        assert (sub not in data.get(section, {})) if sub else section not in data, key
    # a recipe written with every section (as earlier versions wrote recipe.yaml) still loads: defaults are allowed
    full = tmp_path / "full.yaml"
    full.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    assert load_recipe(full) == recipe


@pytest.mark.parametrize(
    ("flags", "key", "value"),
    [
        (["gptq", "--method", "rtn", "--no-mse"], "gptq.mse", False),
        (["gptq", "--damp", "0.05", "--exclude", "o_proj"], "gptq.damp", 0.05),
        (["nvfp4", "--mse-iters", "3"], "nvfp4.mse_iters", 3),
    ],
)
def test_saved_recipes_load_back(flags: list[str], key: str, value, model: Path, tmp_path: Path) -> None:
    saved, afile = tmp_path / "saved.yaml", tmp_path / "afile"
    afile.write_text("")  # an output that is a file: the run is refused right after the recipe is saved
    res = cli(flags[0], "-i", str(model), "-o", str(afile), "--calib", CALIB, *flags[1:], "--save-recipe", str(saved))
    assert res.exit_code == 2 and "is a file, not a folder" in res.output, res.output
    recipe = load_recipe(saved)
    section, name = key.split(".")
    assert getattr(getattr(recipe, section), name) == value


# ------------------------------------------------------------------------------------- sources


def test_tensors_the_architecture_does_not_have_are_refused(model: Path, tmp_path: Path, nowhere: str) -> None:
    state = load_file(model / "model.safetensors")
    state["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    state["model.layers.4.mlp.up_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)  # one layer too many
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    for command in ("gptq", "nvfp4", "calibrate"):
        res = cli(command, "-i", str(model), "-o", str(tmp_path / "q"), "--calib", nowhere, *SMALL)
        line = _refusal(res)
        assert f"{model}: 2 tensor(s) that a MiniCPM-SALA model of this config.json does not have" in line, line
        assert "model.layers.1.mlp.extra_proj.weight, model.layers.4.mlp.up_proj.weight" in line, line
    _nothing_written(tmp_path / "q")


def test_rebuilt_tensors_a_checkpoint_may_store_are_accepted(tmp_path: Path) -> None:
    """Rotary frequencies (older transformers saved them) and, with tied embeddings, a stored lm_head: every
    loader rebuilds or ties them, so the export loses nothing without them."""
    config = dict(preset_config("tiny"), tie_word_embeddings=True)
    path = write_random_checkpoint(tmp_path / "tied", config, seed=4, std=0.05)
    state = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    validate_source(path)
    del state["lm_head.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq_"] = torch.ones(8)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) .* model\.layers\.0\.self_attn\.rotary_emb\.inv_freq_;"):
        validate_source(path)


def _rewrite_header(path: Path, edit, data_edit=lambda d: d) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data_edit(raw[8 + n :]))


def _library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle has no __iter__)
                f.get_tensor(name)
    except Exception:
        return True
    return False


def test_inspect_refuses_a_header_whose_offsets_alias_another_tensor(model: Path) -> None:
    up, gate = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"

    def alias(header: dict) -> None:
        header[up]["data_offsets"] = list(header[gate]["data_offsets"])

    _rewrite_header(model / "model.safetensors", alias)
    assert _library_refuses(model / "model.safetensors")
    line = _refusal(cli("inspect", str(model)))
    assert f"{model / 'model.safetensors'}: tensors '{gate}' and '{up}' share data bytes" in line, line


def _two_tensors(path: Path) -> Path:
    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, path)
    return path


@pytest.mark.parametrize(
    ("case", "edit", "data_edit", "want"),
    [
        ("overlap", lambda h: h["b"].update(data_offsets=[8, 16], shape=[2]), None, "tensors 'a' and 'b' share data"),
        ("gap", lambda h: h["b"].update(data_offsets=[20, 28]), lambda d: d + bytes(4),
         "data bytes [16, 20) between tensors 'a' and 'b' belong to no tensor"),
        ("trailing bytes", None, lambda d: d + bytes(8), "the last 8 bytes of the file belong to no tensor"),
        ("size not the shape's", lambda h: h["b"].update(shape=[3]), None,
         "tensor 'b' of shape [3] and dtype F32 takes 12 bytes, but its data_offsets span 8"),
    ],
)  # fmt: skip
def test_header_layouts_the_format_forbids_are_refused(case: str, edit, data_edit, want: str, tmp_path: Path) -> None:
    """Overlapping, gapped or uncovered data and sizes that do not match the shape: refused here as the
    safetensors library refuses them, from the header alone."""
    path = _two_tensors(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    _rewrite_header(path, edit or (lambda h: None), data_edit or (lambda d: d))
    assert _library_refuses(path), case
    with pytest.raises(CheckpointError, match="the header is damaged") as exc:
        CheckpointReader(tmp_path)
    assert str(exc.value).startswith(f"{path}: ") and want in str(exc.value), exc.value


def test_header_layouts_the_format_allows_are_accepted(tmp_path: Path) -> None:
    """Header order other than data order, and empty tensors: the library reads them, so do we."""
    path = _two_tensors(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")

    def reorder(header: dict) -> None:
        header["a"]["data_offsets"], header["b"]["data_offsets"] = [8, 24], [0, 8]
        header["empty"] = {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]}

    _rewrite_header(path, reorder)
    assert not _library_refuses(path)
    reader = CheckpointReader(tmp_path)
    with safe_open(str(path), "pt") as f:
        for name in ("a", "b", "empty"):
            assert torch.equal(reader.get(name), f.get_tensor(name))


# ------------------------------------------------------------------------------------- patterns


def test_exclude_patterns_and_rules_matching_no_linear_are_refused(model: Path, tmp_path: Path, nowhere: str) -> None:
    typo = r"mlp\.dwon_proj"
    for command in ("gptq", "nvfp4"):
        res = cli(command, "-i", str(model), "-o", str(tmp_path / "q"), "--calib", nowhere, *SMALL,
                   "--exclude", r"layers\.1\.mlp", "--exclude", typo)  # fmt: skip
        assert f"--exclude '{typo}' matches no linear of this model" in _refusal(res)
    gptq = f"method: gptq\nquantization:\n  exclude:\n    - o_proj\n    - {typo}\n"
    both = f"method: nvfp4\nquantization:\n  exclude: ['{typo}']\nnvfp4:\n  exclude: [o_proj]\n"
    rules = "method: gptq\nquantization:\n  rules:\n    - match: mlp\n      bits: 8\n    - match: selfattn\n"
    cases = [
        (gptq, f":5: quantization.exclude[1]: --exclude '{typo}' matches no linear"),
        (f"method: nvfp4\nnvfp4:\n  exclude: [o_proj, '{typo}']\n", f":3: nvfp4.exclude[1]: --exclude '{typo}'"),
        (both, f":3: quantization.exclude[0]: --exclude '{typo}'"),  # after nvfp4.exclude in the plan's list
        (rules + "      bits: 8\n", ":6: quantization.rules[1] match 'selfattn' matches no linear"),
    ]
    for text, want in cases:
        line = _refusal(_run(_recipe(tmp_path, text), model, tmp_path / "q", nowhere))
        assert f"{tmp_path / 'r.yaml'}{want}" in line, line
    _nothing_written(tmp_path / "q")


# ------------------------------------------------------------------------------------- weights


def test_nan_in_the_last_layer_is_found_before_the_calibration_data_is_read(
    model: Path, tmp_path: Path, nowhere: str
) -> None:
    state = load_file(model / "model.safetensors")
    name = "model.layers.3.mlp.down_proj.weight"  # the last tensor the calibration would read
    state[name] = state[name].index_fill(1, torch.tensor([9, 11]), float("nan"))
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    for command in ("gptq", "nvfp4", "calibrate"):
        line = _refusal(cli(command, "-i", str(model), "-o", str(tmp_path / "q"), "--calib", nowhere, *SMALL))
        rows = state[name].shape[0]
        assert f"tensor {name} holds NaN or Inf ({2 * rows} value(s), the first at [0, 9])" in line, line
    _nothing_written(tmp_path / "q")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finiteness_scan_names_the_first_bad_value_across_blocks(
    dtype: torch.dtype, tmp_path: Path, monkeypatch
) -> None:
    import salaquant.model.loading as loading

    monkeypatch.setattr(loading, "SCAN_BLOCK_BYTES", 64)  # many blocks per tensor, a bad value in a later one
    good = torch.randn(5, 37).to(dtype)
    bad = torch.randn(6, 29).to(dtype)
    bad[3, 17], bad[5, 2] = float("inf"), float("-inf")
    save_file({"good": good, "bad": bad, "ids": torch.arange(10)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tensor bad holds NaN or Inf \(2 value\(s\), the first at \[3, 17\]\)"):
        check_finite(CheckpointReader(tmp_path))
    save_file({"good": good, "ids": torch.arange(10)}, tmp_path / "model.safetensors")
    check_finite(CheckpointReader(tmp_path))


# ------------------------------------------------------------------------------------- every setting, before the data


BAD_SETTINGS = [
    ("gptq", ["--damp", "5"], "--damp 5.0: expected a number in (0.0, 1.0]"),
    ("gptq", ["--max-len", "0"], "--max-len 0: expected a number >= 1"),
    ("gptq", ["--bits", "3"], "--bits 3: Input should be 4, 8 or 16"),
    ("gptq", ["--smooth-alpha", "2"], "--smooth-alpha 2.0: expected a number in [0.0, 1.0]"),
    ("nvfp4", ["--mse-iters", "-1"], "--mse-iters -1: expected a number in [0, 10000]"),
    ("nvfp4", ["--chunk-tokens", "0"], "--chunk-tokens 0: expected a number >= 1"),
    ("gptq", ["--shard-size", "0"], "--shard-size 0: expected a size above zero"),
    ("nvfp4", ["--shard-size", "0"], "--shard-size 0: expected a size above zero"),
    ("gptq", ["--shard-size", "0.5"], "--shard-size 0.5: expected a size above zero"),
    ("gptq", ["--min-len", "100", "--max-len", "64"], "--min-len 100: above max_len (64)"),
    ("gptq", ["--field", ""], "--field"),
    ("gptq", ["--method", "rtn", "--act-order"], "--act-order True: method rtn does not read it"),
    ("gptq", ["--budget", "0GB"], "--budget 0GB"),
    ("gptq", ["--budget", "4.5bits", "--bits", "8"], "--budget 4.5bits chooses the bits of every group itself"),
    ("gptq", ["--group-size", "100"], "--group-size 100"),
    ("gptq", ["--layer-bits", "9:4"], "--layer-bits entry '9:4': layers must lie in 0-3"),
    ("gptq", ["--exclude", "("], "not a valid regular expression"),
    ("gptq", ["--chunk-tokens", "0"], "--chunk-tokens 0: expected a number >= 1"),
    ("gptq", ["--propagate", "x"], "--propagate x"),
    ("gptq", ["--hessian-weighting", "x"], "--hessian-weighting x"),
    ("gptq", ["--device", "gpu"], "--device 'gpu': expected auto, cpu, cuda or cuda:N"),
    ("gptq", ["--tp", "0"], "--tp 0: expected a number >= 1"),
    ("nvfp4", ["--budget", "4.5bits", "--dense-all"], "drop --dense-all"),
    ("nvfp4", ["--input-scale", "x"], "--input-scale x"),
    ("nvfp4", ["--exclude", "("], "not a valid regular expression"),
    ("calibrate", ["--chunk-tokens", "0"], "--chunk-tokens 0: expected a number >= 1"),
    ("calibrate", ["--max-len", "0"], "--max-len 0: expected a number >= 1"),
    ("calibrate", ["--max-samples", "0"], "--max-samples 0: expected a number >= 1"),
    ("calibrate", ["--min-len", "100", "--max-len", "64"], "--min-len 100: above max_len (64)"),
    ("calibrate", ["--field", ""], "--field"),
    ("calibrate", ["--hessian-dtype", "fp16"], "--hessian-dtype 'fp16': expected fp32 or fp64"),
    ("run", ["--set", "export.shard_size=0"], "--set export.shard_size=0: export.shard_size: expected a size above"),
    ("run", ["--set", "quantization.budget_windows=0"], "quantization.budget_windows: expected a number >= 1"),
    ("run", ["--set", "calibration.min_len=9", "--set", "calibration.max_len=8"], "calibration.min_len: above max_len"),
]


def test_every_bad_setting_fails_before_the_calibration_data_is_read(model: Path, tmp_path: Path, nowhere: str) -> None:
    """Each value is refused by name (and range, where it has one) in salaquant's own words, no validation
    library's text or link, with the calibration file missing: a check made after the data is read would name that
    file instead (and would have created the work folder)."""
    for command, flags, want in BAD_SETTINGS:
        out = tmp_path / "q"
        head = ["run", "gptq-w4a16"] if command == "run" else [command, *SMALL]
        res = cli(*head, "-i", str(model), "-o", str(out), "--calib", nowhere, *flags)
        line = _refusal(res)
        assert want in line and "no-such-calib" not in line and "max_shard_bytes" not in line, (flags, line)
        assert "pydantic" not in res.output and "http" not in res.output, (flags, res.output)
        _nothing_written(out)
