"""Bad input to every command that writes: nothing lost, nothing mixed, one clear line before any work.

Each test feeds one bad input the way a user would (the command line, or the library call behind it) and checks
the refusal against what the input is: the path, tensor, flag or device it names, the exit status, and what is
left on disk. File-system faults a CI machine cannot produce as root (a read-only mount, a full disk) are injected
at the call that meets them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from cli_checks import SMALL, cli, one_error_line, text
from lock_holder import lock_held
from rich.console import Console
from safetensors.torch import load_file, save_file
from shipped import CALIB, SHIPPED

from salaquant import outputs
from salaquant.calibration.contract import EngineOptions, LayerResult
from salaquant.calibration.engine import CalibrationEngine
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.work_folder import ResumeError

QUIET = Console(quiet=True)


def _gptq(model: Path, out: Path, *extra: str):
    return cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, *extra)


@pytest.fixture()
def model(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny random checkpoint (tests damage theirs)."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))


def _edit(model: Path, name: str, edit) -> None:
    state = load_file(model / "model.safetensors")
    state[name] = edit(state[name])
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})


def _poke(model: Path, name: str, edit) -> None:
    """Replace tensor ``name``'s bytes in place: the file keeps its header, size and layout."""
    from salaquant.io.reader import CheckpointReader

    reader = CheckpointReader(model)
    new = edit(reader.get(name)).contiguous()
    offset, path = reader._info(name).offset, model / reader.shard_of(name)
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(new.view(torch.uint8).numpy().tobytes())


# ------------------------------------------------------------------------------------- 1. data loss


def test_output_that_is_the_input_is_refused_even_with_overwrite(model: Path) -> None:
    before = (model / "model.safetensors").read_bytes()
    files = sorted(p.name for p in model.iterdir())
    for command in ("gptq", "nvfp4", "calibrate"):
        res = cli(command, "-i", str(model), "-o", str(model), "--calib", CALIB, *SMALL, "--overwrite")
        assert res.exit_code == 2, res.output
        assert f"is the input checkpoint {model}" in one_error_line(res)
    res = cli("run", "rtn-w4a16", "-i", str(model), "-o", str(model), "--calib", CALIB, "--overwrite")
    assert res.exit_code == 2 and "is the input checkpoint" in text(res)
    assert (model / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in model.iterdir()) == files
    assert not list(model.parent.glob(".model.tmp-*")) and not (model.parent / "model.work").exists()


def test_output_inside_around_or_linked_to_the_input_is_refused(model: Path, tmp_path: Path) -> None:
    res = _gptq(model, model / "sub")
    assert res.exit_code == 2 and f"lies inside the input checkpoint {model}" in one_error_line(res)
    link = tmp_path / "link"
    link.symlink_to(model)
    res = _gptq(link, model, "--overwrite")  # the same folder under another name
    assert res.exit_code == 2 and "is the input checkpoint" in text(res)
    res = _gptq(model, tmp_path, "--overwrite")  # the output folder holds the input
    assert res.exit_code == 2 and "contains the input checkpoint" in text(res)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(CALIB, data / "c.jsonl")
    res = cli("gptq", "-i", str(model), "-o", str(data), "--calib", str(data / "c.jsonl"), *SMALL, "--overwrite")
    assert res.exit_code == 2 and "contains the calibration source" in text(res)
    assert (data / "c.jsonl").exists() and (model / "model.safetensors").exists()
    res = cli("demo", "--out", str(model), "--model", str(model), "--overwrite")
    assert res.exit_code == 2 and "--out" in text(res) and "is the model" in text(res)


# ------------------------------------------------------------------------------------- 2. no mixing on resume


class _Interrupt:
    """Fake quantization (scale every linear by 0.5) interrupted at layer ``at``."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at

    def quantize_layer(self, index, layer, stats) -> LayerResult:
        if index == self.at:
            raise KeyboardInterrupt
        for p in layer.parameters():
            p.data.mul_(0.5)
        return LayerResult(layer=layer, tensors={"w": layer.mlp.up_proj.weight.detach().clone()})


def _engine(model: Path, work: Path) -> CalibrationEngine:
    samples = [torch.arange(40) % 200 + 3, torch.arange(25) % 100 + 7]
    opts = EngineOptions(device="cpu", show_progress=False, resume_every=2, background_writes=False)
    return CalibrationEngine(model, samples, work, opts)


def test_resume_refuses_a_checkpoint_of_the_same_layout_with_other_weights(model: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        _engine(model, work).run(_Interrupt(at=3))  # layers 0 and 1 finished
    other = tmp_path / "other"
    write_random_checkpoint(other, preset_config("tiny"), seed=9, std=0.05)
    shutil.copy(other / "model.safetensors", model / "model.safetensors")  # same names, shapes and sizes
    with pytest.raises(ResumeError, match=r"tensor model\.\S+ in .* is not the one the finished layers read"):
        _engine(model, work).run(_Interrupt(), resume=True)


def test_resume_refuses_a_changed_tensor_of_a_finished_layer_only(model: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        _engine(model, work).run(_Interrupt(at=3))
    state = json.loads((work / "state.json").read_text())
    assert "model.layers.1.mlp.up_proj.weight" in state["tensors"]
    assert "model.layers.2.mlp.up_proj.weight" not in state["tensors"]  # not read by a finished layer
    _poke(model, "model.layers.2.mlp.up_proj.weight", lambda t: t * 2)  # a layer still to run: accepted
    _engine(model, work).run(_Interrupt(), resume=True)
    with pytest.raises(KeyboardInterrupt):
        _engine(model, tmp_path / "w2").run(_Interrupt(at=3))
    _poke(model, "model.layers.1.mlp.up_proj.weight", lambda t: t.flip(0))  # same values in another order
    with pytest.raises(ResumeError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        _engine(model, tmp_path / "w2").run(_Interrupt(), resume=True)


def test_resume_refuses_another_salaquant_version(model: Path, tmp_path: Path, monkeypatch) -> None:
    import salaquant.calibration.engine as pipeline

    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        _engine(model, work).run(_Interrupt(at=3))
    monkeypatch.setattr(pipeline, "__version__", "0.0.0-other")
    with pytest.raises(ResumeError, match="salaquant version"):
        _engine(model, work).run(_Interrupt(), resume=True)


def test_a_second_run_on_the_same_work_folder_is_refused_by_the_lock(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    work = outputs.work_dir_for(out)
    work.mkdir()
    with lock_held(work) as holder:
        res = _gptq(model, out)
        assert res.exit_code == 2, res.output
        assert f"another salaquant run (pid {holder.pid}) is using {work}" in one_error_line(res)
        assert not out.exists()
    fd = os.open(work / "lock", os.O_RDWR)  # the refused run did not take or break the lock file
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


# ------------------------------------------------------------------------------------- 3. validate first


def test_checkpoint_checked_from_headers_before_calibration_data_is_read(model: Path, tmp_path: Path) -> None:
    missing_calib = str(tmp_path / "no-such-calib.jsonl")
    state = load_file(model / "model.safetensors")
    del state["model.layers.2.mlp.down_proj.weight"]
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    for command in ("gptq", "nvfp4", "calibrate"):
        res = cli(command, "-i", str(model), "-o", str(tmp_path / "o"), "--calib", missing_calib, *SMALL)
        assert res.exit_code == 2, res.output
        assert "tensor model.layers.2.mlp.down_proj.weight is missing" in one_error_line(res)
    state["model.layers.2.mlp.down_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    res = cli("gptq", "-i", str(model), "-o", str(tmp_path / "o"), "--calib", missing_calib, *SMALL)
    assert "model.layers.2.mlp.down_proj.weight has shape [3, 3], expected [128, 256]" in text(res)
    state["model.layers.2.mlp.down_proj.weight"] = torch.zeros(128, 256, dtype=torch.int32)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    res = cli("gptq", "-i", str(model), "-o", str(tmp_path / "o"), "--calib", missing_calib, *SMALL)
    assert "down_proj.weight has dtype torch.int32" in text(res)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.work").exists()


def test_an_export_is_refused_as_the_source(tmp_path: Path) -> None:
    export = tmp_path / "q"
    assert _gptq(SHIPPED, export, "--method", "rtn").exit_code == 0
    res = _gptq(export, tmp_path / "again")
    assert res.exit_code == 2 and "already quantized" in one_error_line(res) and "'gptq'" in text(res)


def test_nan_weight_named_and_the_work_folder_removed(model: Path, tmp_path: Path) -> None:
    _edit(model, "model.layers.2.mlp.up_proj.weight", lambda t: t.index_fill(0, torch.tensor([5]), float("nan")))
    out = tmp_path / "q"
    for _ in range(2):  # the second run gives the same answer, not "pass --resume" / "remove it"
        res = _gptq(model, out)
        assert res.exit_code == 2, res.output
        line = one_error_line(res)
        assert "tensor model.layers.2.mlp.up_proj.weight holds NaN or Inf" in line and "first at [5, 0]" in line
        assert "finite 2-D" not in line
        assert not out.exists() and not outputs.work_dir_for(out).exists()


# ------------------------------------------------------------------------------------- 4. no silent wrong answers


@pytest.fixture(scope="module")
def export(shipped_rtn_export: Path) -> Path:
    return shipped_rtn_export


def test_generate_refuses_an_export_with_nan_scales(export: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(export, tmp_path / "nan"))
    _edit(bad, "model.layers.3.mlp.down_proj.scales", lambda t: t.index_fill(1, torch.tensor([7]), float("nan")))
    res = cli("generate", str(bad), "--prompt", "The", "--max-new-tokens", "8", "--device", "cpu")
    assert res.exit_code == 2, res.output
    assert "tensor model.layers.3.mlp.down_proj.scales holds NaN or Inf" in one_error_line(res)


def test_generate_fails_on_nan_logits_from_finite_weights(export: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(export, tmp_path / "overflow"))
    _edit(bad, "model.layers.5.self_attn.o_norm.weight", lambda t: torch.full_like(t, 3e38))
    res = cli("generate", str(bad), "--prompt", "The", "--max-new-tokens", "8", "--device", "cpu")
    assert res.exit_code == 2, res.output
    assert "NaN/Inf logits at generated token 0" in one_error_line(res)


def test_check_refuses_a_config_that_disagrees_with_the_tensors(export: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(export, tmp_path / "cfg"))
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(config))
    res = cli("check", str(bad))
    assert res.exit_code == 1, res.output
    n = config["intermediate_size"]
    assert f"model.layers.0.mlp.gate_proj.qweight: {n // 2} outputs, config.json implies {n}" in text(res)
    assert cli("check", str(export)).exit_code == 0


def test_eval_refuses_swapped_roles(export: Path, tmp_path: Path) -> None:
    common = ["--device", "cpu", "--windows", "1", "--max-len", "64", "--niah", "none", "--gen-tokens", "0"]
    res = cli("eval", str(SHIPPED), "-r", str(SHIPPED), *common)
    assert res.exit_code == 2 and f"{SHIPPED} is a bf16 checkpoint" in text(res) and "not an export" in text(res)
    res = cli("eval", str(export), "-r", str(export), *common)
    assert res.exit_code == 2 and f"--reference {export} is a gptq export, not a bf16 source" in text(res)
    assert not (SHIPPED / "eval.json").exists() and not (export / "eval.json").exists()


# ------------------------------------------------------------------------------------- 5. file system, device


def test_output_paths_refused_up_front(model: Path, tmp_path: Path) -> None:
    missing_calib = str(tmp_path / "no-such-calib.jsonl")  # never reached: the output is refused first
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    res = cli("gptq", "-i", str(model), "-o", str(afile / "x"), "--calib", missing_calib, *SMALL)
    assert res.exit_code == 2 and f"{afile} is a file, not a folder" in one_error_line(res)
    res = cli("gptq", "-i", str(model), "-o", str(afile), "--calib", missing_calib, *SMALL, "--overwrite")
    assert res.exit_code == 2 and f"--output {afile} is a file, not a folder" in one_error_line(res)
    assert afile.read_text() == "keep me"


def test_read_only_or_unwritable_parent_is_refused(model: Path, tmp_path: Path, monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(outputs.tempfile, "mkdtemp", refuse)
    res = _gptq(model, tmp_path / "ro" / "q")
    assert res.exit_code == 2, res.output
    assert f"cannot write in {tmp_path} (Read-only file system)" in one_error_line(res)
    monkeypatch.undo()
    if os.geteuid() != 0:  # a real permission, where the user is not root (root writes anyway)
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        res = _gptq(model, locked / "q")
        assert res.exit_code == 2 and "cannot write in" in text(res)


def test_disk_full_during_calibration(model: Path, tmp_path: Path, monkeypatch) -> None:
    import salaquant.calibration.engine as pipeline

    real = pipeline.write_safetensors

    def fill_disk(tensors, path, metadata=None):
        if "layers/002" in str(path):
            Path(path).write_bytes(b"\0" * 100)  # what a write cut short leaves
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(tensors, path, metadata)

    monkeypatch.setattr(pipeline, "write_safetensors", fill_disk)
    out = tmp_path / "q"
    res = _gptq(model, out)
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    work = outputs.work_dir_for(out)  # on a CPU the two layers finished before are kept for --resume
    assert "q.work/layers/002.safetensors.tmp: No space left on device" in line
    assert (
        f"layers 1-2 of 4 are kept in {work}: once the cause is fixed, rerun with --resume to continue from layer 3"
        in line
    )
    assert not out.exists() and json.loads((work / "state.json").read_text())["finished"] == 2
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.glob(".q.tmp-*"))


def test_cuda_without_cuda_is_refused_before_work(model: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = cli("gptq", "-i", str(model), "-o", str(tmp_path / "q"), "--calib", CALIB, "--device", "cuda")
    assert res.exit_code == 2 and "--device cuda: CUDA is not available on this machine" in one_error_line(res)
    res = cli("generate", str(model), "--device", "cuda:3")
    assert res.exit_code == 2 and "--device cuda:3: CUDA is not available" in text(res)
    res = cli("gptq", "-i", str(model), "-o", str(tmp_path / "q"), "--calib", CALIB, "--device", "gpu")
    assert res.exit_code == 2 and "--device 'gpu': expected auto, cpu, cuda or cuda:N" in text(res)
    assert not (tmp_path / "q.work").exists()


def test_not_enough_free_space_is_refused(model: Path, tmp_path: Path, monkeypatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda _p: usage._replace(free=500))
    res = _gptq(model, tmp_path / "q")
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"not enough free space for {tmp_path / 'q'}" in line and "500 B free" in line
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.work").exists()


def test_leftovers_of_a_killed_export_are_removed(model: Path, tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".q.tmp-{dead.pid}-abc"
    (stale / "x").mkdir(parents=True)
    live = tmp_path / f".q.tmp-{os.getppid()}-abc"  # a writer still running: left alone
    live.mkdir()
    res = _gptq(model, tmp_path / "q")
    assert res.exit_code == 0, res.output
    assert not stale.exists() and live.exists()


def test_ctrl_c_says_what_was_kept_and_resume_finishes(model: Path, tmp_path: Path, monkeypatch) -> None:
    import salaquant.driver as command  # the pipeline every method's command runs

    out = tmp_path / "q"
    real = command.export_checkpoint

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "export_checkpoint", interrupted)  # Ctrl-C while the export is written
    res = _gptq(model, out)
    assert res.exit_code == 130, res.output
    work = outputs.work_dir_for(out)
    assert f"interrupted: all 4 calibrated layers are kept in {work}: rerun the same command with --resume" in text(res)
    assert not out.exists() and (work / "state.json").exists()
    monkeypatch.setattr(command, "export_checkpoint", real)
    res = _gptq(model, out)  # neither --resume nor --overwrite: refused with both choices named
    assert res.exit_code == 2 and "--resume to continue it, or with --overwrite" in text(res)
    res = _gptq(model, out, "--resume")
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").exists() and not work.exists()


# ------------------------------------------------------------------------------------- 6. what a server expects


def test_export_is_readable_by_others_and_holds_what_serving_needs(export: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    assert export.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in export.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
    names = {p.name for p in export.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"} <= names
    assert (SHIPPED / "heldout.jsonl").exists() and (SHIPPED / "train_summary.json").exists()
    assert "heldout.jsonl" not in names and "train_summary.json" not in names


def test_eval_writes_a_report_only_when_asked(export: Path, tmp_path: Path) -> None:
    common = ["--device", "cpu", "--windows", "1", "--max-len", "64", "--niah", "none", "--gen-tokens", "0"]
    before = sorted(p.name for p in export.iterdir())
    res = cli("eval", str(export), "-r", str(SHIPPED), *common, "--layer-windows", "0")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in export.iterdir()) == before
    res = cli("eval", str(export), "-r", str(SHIPPED), *common, "--layer-windows", "0", "--report", str(tmp_path))
    assert res.exit_code == 0 and (tmp_path / "eval.json").exists() and (tmp_path / "eval.png").exists()


def test_demo_without_out_writes_to_a_new_temp_folder(tmp_path: Path, monkeypatch) -> None:
    from salaquant.demo import _prepare_output

    monkeypatch.chdir(tmp_path)
    said = Console(record=True, width=200)
    out = _prepare_output(None, False, [], said)
    assert out.is_dir() and not any(out.iterdir())
    assert out.parent == Path(tempfile.gettempdir()) and out.name.startswith("salaquant-demo-")
    assert str(out) in said.export_text() and not any(tmp_path.iterdir())
    out.rmdir()


# ------------------------------------------------------------------------------------- 7. output in a pipe


def test_progress_in_a_log_is_plain_lines(model: Path, tmp_path: Path, capsys) -> None:
    samples = [torch.arange(40) % 200 + 3]
    CalibrationEngine(model, samples, tmp_path / "w", EngineOptions(device="cpu")).run()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any("calibration: 4 layers (0 done), 1 samples, 40 tokens" in line for line in lines), err
    for i in range(1, 5):
        assert any(f"layer {i}/4 done" in line for line in lines), err
    assert "\x1b[" not in err and "━" not in err  # no escape codes, no bars


def test_tables_and_generated_text_are_not_wrapped_in_a_pipe(export: Path) -> None:
    res = cli("inspect", str(SHIPPED))
    assert res.exit_code == 0 and max(len(line) for line in res.output.splitlines()) > 80
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 2
    res = cli("generate", str(export), "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert prompt in res.output  # on one line, as given
