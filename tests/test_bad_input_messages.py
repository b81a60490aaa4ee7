"""Bad input ends in one line of salaquant's own: the file, flag or key named, exit 2, never a traceback.

Each test feeds a bad input the way a user would (the command line, or the console script in a subprocess) and
checks the one ``error:`` line against what the input is: the path, flag or key it must name, the exit status,
and what is left on disk. A full disk is injected where a real one fails: at the ``write`` call, whose error
names no file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import SMALL, cli, one_error_line
from shipped import CALIB, ROOT, SHIPPED

from salaquant import outputs

EVAL = ["--device", "cpu", "--windows", "1", "--max-len", "64", "--gen-tokens", "0", "--layer-windows", "0"]


def _one_error_line(res) -> str:
    """The refusal: exactly one ``error:`` line, no traceback, nothing raised past the command."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)[:500]
    return one_error_line(res)


def _refused(res, *names: str) -> str:
    """Exit 2 with one error line that holds every one of ``names``."""
    line = _one_error_line(res)
    assert res.exit_code == 2, res.output
    for name in names:
        assert name in line, (name, line)
    return line


@pytest.fixture()
def model(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny random checkpoint (tests damage theirs)."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    """An NVFP4 export of the tiny checkpoint (one calibration sample: a few seconds)."""
    from conftest import small_nvfp4_export

    return small_nvfp4_export(tiny_ckpt, tmp_path_factory.mktemp("nvfp4") / "q")


# ------------------------------------------------------------------------------------- eval lengths


def _with_positions(src: Path, dst: Path, positions: int) -> Path:
    """A copy of checkpoint ``src`` whose config.json says it holds ``positions`` positions."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_eval_lengths_past_the_models_positions_are_refused_first(
    export: Path, tiny_ckpt: Path, tmp_path: Path
) -> None:
    res = cli("eval", str(export), "-r", str(tiny_ckpt), *EVAL, "--niah", "2m")
    _refused(res, "--niah 2m", "4096 positions", f"max_position_embeddings in {export}/config.json")
    source = _with_positions(tiny_ckpt, tmp_path / "src", 512)
    short = _with_positions(export, tmp_path / "q", 512)
    cases = [
        (["--niah", "1k"], "--niah 1k"),
        (["--niah", "none", "--tasks", "vt", "--lengths", "1k"], "--lengths 1k"),
        (["--niah", "none", "--max-len", "1024", "--windows", "1"], "--max-len 1k"),
    ]
    for flags, name in cases:
        res = cli("eval", str(short), "-r", str(source), *EVAL, *flags)
        _refused(res, name, "512 positions", f"{short}/config.json")


# ------------------------------------------------------------------------------------- files of the wrong kind


def test_a_binary_or_folder_recipe_is_named(model: Path, tmp_path: Path) -> None:
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 8)  # not UTF-8 text
    for recipe in (binary, tmp_path):
        res = cli("run", str(recipe), "-i", str(model), "-o", str(tmp_path / "q"), "--calib", CALIB)
        _refused(res, f"{recipe}: ")
        assert "codec" not in res.output
    assert not (tmp_path / "q").exists()


def test_inspect_of_a_weights_file_says_what_it_is_not() -> None:
    res = cli("inspect", str(SHIPPED / "model.safetensors"))
    _refused(res, f"{SHIPPED / 'model.safetensors'} is not a checkpoint folder or its config.json")


def test_a_file_given_for_a_checkpoint_folder_is_named(tmp_path: Path) -> None:
    for given in (SHIPPED / "model.safetensors", SHIPPED / "config.json"):
        for command in ("gptq", "nvfp4", "calibrate"):
            res = cli(command, "-i", str(given), "-o", str(tmp_path / "q"), "--calib", CALIB, *SMALL)
            _refused(res, f"checkpoint path {given} is not a folder")
        res = cli("generate", str(given), "--device", "cpu", "--max-new-tokens", "4")
        _refused(res, f"checkpoint path {given} is not a folder")
        assert "valid JSON" not in res.output and "codec" not in res.output
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.work").exists()


def test_tiny_refuses_bad_options_naming_the_flag(tmp_path: Path) -> None:
    cases = [
        (["--std", "-1"], "--std -1.0: expected a finite number above 0"),
        (["--std", "inf"], "--std inf"),
        (["--std", "nan"], "--std nan"),
        (["--device", "gpu"], "--device 'gpu'"),
        (["--device", "cuda:99"], "--device cuda:99"),
        (["--shard-size", "0"], "--shard-size: size '0': expected a size above zero"),
        (["--shard-size", "infGB"], "--shard-size"),
        (["--seed", str(2**64)], f"--seed {2**64}"),
    ]
    for flags, want in cases:
        res = cli("tiny", str(tmp_path / "t"), *flags)
        _refused(res, want)
        assert not (tmp_path / "t").exists()


# ------------------------------------------------------------------------------------- check: exit 1 or 2


def test_check_exits_2_on_bad_input_and_1_on_a_failed_format(export: Path, tmp_path: Path) -> None:
    assert cli("check", str(export)).exit_code == 0
    bad = Path(shutil.copytree(export, tmp_path / "q"))
    (bad / "hf_quant_config.json").write_text('{"producer": ')
    _refused(cli("check", str(bad)), f"{bad / 'hf_quant_config.json'}: cannot parse")
    (bad / "hf_quant_config.json").write_text("[1, 2]")
    _refused(cli("check", str(bad)), f"{bad / 'hf_quant_config.json'}: top level is not a JSON object")
    (bad / "config.json").write_bytes(b"\xff\xfe")
    _refused(cli("check", str(bad)), f"{bad / 'config.json'}: cannot parse")
    _refused(cli("check", str(tmp_path / "missing")), f"{tmp_path / 'missing'} does not exist")
    _refused(cli("check", str(export / "model.safetensors")), "is not a folder")
    _refused(cli("check", str(export), "--tp", "0"), "--tp 0")
    (bad / "hf_quant_config.json").unlink()  # readable, but a served checkpoint needs the file
    shutil.copy(export / "config.json", bad / "config.json")
    res = cli("check", str(bad))
    assert res.exit_code == 1 and "hf_quant_config.json is missing" in res.output, res.output
    assert "Exit status: 0 the checkpoint passes, 1 it fails the format requirements" in " ".join(
        cli("check", "--help").output.split()
    )


# ------------------------------------------------------------------------------------- generate checks first


def test_generate_refuses_a_config_that_disagrees_with_the_tensors(export: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(export, tmp_path / "cfg"))
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(config))
    res = cli("generate", str(bad), "--prompt", "The", "--max-new-tokens", "4", "--device", "cpu")
    n, packed = config["intermediate_size"], config["hidden_size"] // 2  # two FP4 codes a byte
    want = f"model.layers.0.mlp.gate_proj.weight: shape [{n // 2}, {packed}], config.json implies [{n}, {packed}]"
    _refused(res, f"{bad}: the tensors disagree with config.json", want)


def test_backend_triton_without_cuda_is_refused_before_loading(export: Path, tiny_ckpt: Path, monkeypatch) -> None:
    from salaquant.kernels import device

    monkeypatch.setattr(device, "INTERPRET", False)  # as a user runs it (the CPU test suite interprets Triton)
    res = cli("generate", str(export), "--max-new-tokens", "4", "--device", "cpu", "--backend", "triton")
    _refused(res, "--backend triton: the Triton kernels need a CUDA device", "--backend reference")
    res = cli("eval", str(export), "-r", str(tiny_ckpt), *EVAL, "--niah", "none", "--backend", "triton")
    _refused(res, "--backend triton: the Triton kernels need a CUDA device")
    res = cli("generate", str(export), "--max-new-tokens", "4", "--device", "cpu", "--backend", "trion")
    _refused(res, "--backend 'trion': expected auto, triton, reference")


def test_lm_eval_command_without_the_extra_names_it() -> None:
    found = re.search(r'^salaquant-lm-eval = "([\w.]+):(\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml declares the salaquant-lm-eval script"
    module, function = found.groups()
    code = f"import sys; sys.modules['lm_eval'] = None; sys.argv = ['salaquant-lm-eval']; import {module}; "
    code += f"{module}.{function}()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install 'salaquant[lm-eval]'" in errors[0], proc.stderr


# ------------------------------------------------------------------------------------- tokenizer files


def test_a_missing_or_corrupt_tokenizer_file_is_named(
    model: Path, export: Path, tiny_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "q"
    (model / "tokenizer.json").unlink()
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL)
    _refused(res, f"{model / 'tokenizer.json'} is missing")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_ckpt / "tokenizer.json", model / "tokenizer.json")
        (model / name).write_text('{"version": ')
        res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL)
        _refused(res, f"{model / name}: cannot parse")
        shutil.copy(tiny_ckpt / name, model / name)
    assert not out.exists() and not outputs.work_dir_for(out).exists()
    bad = Path(shutil.copytree(export, tmp_path / "e"))
    (bad / "tokenizer.json").unlink()
    res = cli("generate", str(bad), "--max-new-tokens", "4", "--device", "cpu")
    _refused(res, f"{bad / 'tokenizer.json'} is missing")
    (bad / "tokenizer.json").write_text("{}")  # JSON, but not a tokenizer
    res = cli("generate", str(bad), "--max-new-tokens", "4", "--device", "cpu")
    _refused(res, f"{bad}: cannot build the tokenizer from tokenizer.json")
    source = Path(shutil.copytree(tiny_ckpt, tmp_path / "src"))
    (source / "tokenizer.json").write_text("[")
    res = cli("eval", str(export), "-r", str(source), *EVAL, "--niah", "none")
    _refused(res, f"{source / 'tokenizer.json'}: cannot parse")


# ------------------------------------------------------------------------------------- a full disk


class _FullDisk:
    """A file whose ``write`` fails as a full disk's does: part of the bytes land, and the error names no file."""

    def __init__(self, file) -> None:
        self.file = file

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *_exc) -> None:
        self.file.close()

    def write(self, data) -> int:
        self.file.write(bytes(data)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_names_the_file_being_written(model: Path, tmp_path: Path, monkeypatch) -> None:
    import salaquant.io.safetensors_stream as stream

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115
        return _FullDisk(f) if "layers/000" in str(path) else f

    monkeypatch.setattr(stream, "open", open_on_a_full_disk, raising=False)
    out = tmp_path / "q"
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL)
    work = outputs.work_dir_for(out)
    _refused(res, f"{work}/layers/000.safetensors.tmp: No space left on device")
    assert not out.exists() and not work.exists() and not list(tmp_path.rglob("*.tmp"))


def test_disk_full_while_exporting_names_the_file(tmp_path: Path, monkeypatch) -> None:
    import torch

    from salaquant.io.writer import CheckpointWriter

    real = Path.write_text

    def full_disk(self: Path, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "q"
    with pytest.raises(OSError) as info, CheckpointWriter(out) as writer:
        writer.add("w", torch.zeros(4))
        writer.write_json("config.json", {"model_type": "minicpm_sala"})
    staged = Path(info.value.filename)
    assert staged.name == "config.json" and staged.parent.parent == tmp_path
    assert staged.parent.name.startswith(".q.tmp-") and "No space left on device" in str(info.value)
    assert not out.exists() and not staged.parent.exists()


# ------------------------------------------------------------------------------------- demo


def test_demo_names_the_users_missing_files(tmp_path: Path) -> None:
    nope = tmp_path / "nope.jsonl"
    res = cli("demo", "--quick", "--calib", str(nope), "-o", str(tmp_path / "d"))
    line = _refused(res, f"--calib {nope}: no such file")
    assert "shipped" not in line
    res = cli("demo", "--quick", "--model", str(tmp_path / "none"), "-o", str(tmp_path / "d"))
    assert "shipped" not in _refused(res, f"--model {tmp_path / 'none'}: no such file")
    assert not (tmp_path / "d").exists()
