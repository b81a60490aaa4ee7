"""`--overwrite` and every other replacement never delete what salaquant did not write.

A folder salaquant wrote (an export, a random checkpoint, calibration statistics, eval reports, a demo, a work
folder) is replaced with `--overwrite`; an empty one is written without it; any other folder is refused with and
without the flag, naming a few of its entries, and is left as it was. Each test feeds the folder the way a user
would (the command line, or the library call behind it) and checks the exit status, the names the refusal gives
and what is left on disk.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from cli_checks import SMALL, cli, one_error_line
from rich.console import Console
from safetensors.torch import load_file
from shipped import CALIB, HELDOUT, SHIPPED

from salaquant import outputs
from salaquant.io.writer import CheckpointWriter

SMALLER = ["--max-samples", "2", "--max-len", "32", "--device", "cpu"]
EVAL = ["--device", "cpu", "--windows", "1", "--max-len", "64", "--niah", "none", "--gen-tokens", "0"]


def _user_folder(path: Path) -> dict[str, str]:
    """A folder of the user's own: a note and a sub-folder with a file; returns what it holds."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "data.txt").write_text("also mine")
    return _contents(path)


def _contents(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture()
def model(tiny_ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))


@pytest.fixture(scope="module")
def export(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A round-to-nearest GPTQ export of the tiny checkpoint, written by salaquant (2 samples of 32 tokens)."""
    out = tmp_path_factory.mktemp("export") / "q"
    res = cli("gptq", "-i", str(tiny_ckpt), "-o", str(out), "--calib", CALIB, "--method", "rtn", *SMALLER)
    assert res.exit_code == 0, res.output
    return out


def _refused_as_foreign(res, path: Path, *names: str) -> None:
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"{path} holds files salaquant did not write ({', '.join(names)})" in line, line
    assert "pass --overwrite" not in line  # advice that would not work is not given


# ------------------------------------------------------------------------------------- gptq, nvfp4, run, calibrate


def test_gptq_refuses_a_folder_it_did_not_write_with_and_without_overwrite(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = _user_folder(out)
    for flags in ((), ("--overwrite",)):
        res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, *flags)
        _refused_as_foreign(res, out, "notes.txt", "sub/")
        assert _contents(out) == before and not outputs.work_dir_for(out).exists()


def test_every_quantizing_command_refuses_a_foreign_folder_with_overwrite(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = _user_folder(out)
    for command in (
        ["nvfp4", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL],
        ["calibrate", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL],
        ["run", "rtn-w4a16", "-i", str(model), "-o", str(out), "--calib", CALIB],
    ):
        res = cli(*command, "--overwrite")
        _refused_as_foreign(res, out, "notes.txt", "sub/")
        assert _contents(out) == before, command[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    outputs.check_output(empty, overwrite=False, resume=False)  # an empty folder: written without the flag


def test_a_salaquant_export_is_replaced_only_with_overwrite(model: Path, export: Path, tmp_path: Path) -> None:
    out = Path(shutil.copytree(export, tmp_path / "q"))  # an export salaquant wrote (2 samples of 32 tokens)
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, "--method", "rtn")
    assert res.exit_code == 2, res.output
    assert f"--output {out} is a checkpoint salaquant wrote: pass --overwrite to replace it" in one_error_line(res)
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, "--method", "rtn", "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "salaquant_settings.json").read_text())["calibration"]["max_len"] == 64
    (out / "notes.txt").write_text("added by the user")  # now the export holds a file of the user's
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, "--overwrite")
    _refused_as_foreign(res, out, "notes.txt")
    assert (out / "notes.txt").read_text() == "added by the user" and (out / "model.safetensors").exists()


def test_a_work_folder_of_the_users_is_never_cleared(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    work = outputs.work_dir_for(out)
    before = _user_folder(work)
    res = cli("gptq", "-i", str(model), "-o", str(out), "--calib", CALIB, *SMALL, "--overwrite")
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"{work}, the work folder of this output, holds files salaquant did not write (notes.txt, sub/)" in line
    assert _contents(work) == before and not out.exists()


def test_a_file_added_during_a_run_stops_the_replacement(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with CheckpointWriter(out) as w:
        w.write_json("salaquant_settings.json", {"method": "random"})
        w.add("x", torch.ones(2))
    foreign = r"holds files salaquant did not write \(notes\.txt\)"
    # the writer is accepted (salaquant wrote the folder); the note appears while it writes
    with pytest.raises(outputs.OutputError, match=foreign), CheckpointWriter(out, overwrite=True) as w:
        w.add("x", torch.zeros(2))
        (out / "notes.txt").write_text("written while the run was going")
    assert (out / "notes.txt").exists() and load_file(out / "model.safetensors")["x"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or backup folder left
    with pytest.raises(outputs.OutputError, match=foreign):  # refused when made, too
        CheckpointWriter(out, overwrite=True)


# ------------------------------------------------------------------------------------- the gate's folders


def test_gate_folders_of_the_users_are_refused_before_any_work(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "g"
    gate = ["--set", f"eval.data={HELDOUT}", "--set", "eval.seq_len=128", "--set", "eval.windows=1"]
    for suffix, role in ((".check-failed", "failing its check is kept"), (".gate-failed", "failing its gate is kept")):
        folder = Path(f"{out}{suffix}")
        before = _user_folder(folder)
        res = cli("run", "rtn-w4a16", "-i", str(model), "-o", str(out), "--calib", CALIB, *gate, "--overwrite")
        assert res.exit_code == 2, res.output
        line = one_error_line(res)
        assert f"{folder}, " in line and role in line, line
        assert "holds files salaquant did not write (notes.txt, sub/)" in line
        assert _contents(folder) == before and not out.exists() and not outputs.work_dir_for(out).exists()
        shutil.rmtree(folder)


# ------------------------------------------------------------------------------------- tiny, demo


def test_tiny_names_its_flag_and_keeps_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "t"
    out.mkdir()  # an empty folder is written without --overwrite
    assert cli("tiny", str(out), "--seed", "1").exit_code == 0
    res = cli("tiny", str(out), "--seed", "2")
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"{out} is a checkpoint salaquant wrote: pass --overwrite to replace it" in line
    assert "overwrite=True" not in res.output
    assert cli("tiny", str(out), "--seed", "2", "--overwrite").exit_code == 0
    mine = tmp_path / "mine"
    before = _user_folder(mine)
    _refused_as_foreign(cli("tiny", str(mine), "--overwrite"), mine, "notes.txt", "sub/")
    assert _contents(mine) == before


def test_demo_refuses_a_foreign_folder_and_replaces_only_salaquant_ones(export: Path, tmp_path: Path) -> None:
    from salaquant.demo import FOLDERS, _prepare_output, _write_result

    out = tmp_path / "d"
    (out / FOLDERS[1]).mkdir(parents=True)  # a folder of the user's under a name the demo writes
    (out / FOLDERS[1] / "results.txt").write_text("mine")
    res = cli("demo", "--quick", "-o", str(out), "--overwrite")
    _refused_as_foreign(res, out, f"{FOLDERS[1]}/")
    assert (out / FOLDERS[1] / "results.txt").read_text() == "mine"

    quiet = Console(quiet=True)
    other = Path(shutil.copytree(export, tmp_path / "export"))  # a folder salaquant wrote for something else
    with pytest.raises(outputs.OutputError, match="is a checkpoint salaquant wrote: pass --overwrite"):
        _prepare_output(other, False, [], quiet)
    assert (other / "model.safetensors").exists()
    assert _prepare_output(other, True, [], quiet) == other and not any(other.iterdir())

    earlier = tmp_path / "earlier"  # an earlier demo's folder: the demo's own, reused as it is
    earlier.mkdir()
    _write_result(earlier, {"rows": []})
    shutil.copytree(export, earlier / FOLDERS[0])
    assert _prepare_output(earlier, False, [], quiet) == earlier and (earlier / FOLDERS[0] / "config.json").exists()


# ------------------------------------------------------------------------------------- eval --report


def test_eval_report_never_goes_into_the_source(export: Path, tiny_ckpt: Path, tmp_path: Path) -> None:
    source = Path(shutil.copytree(tiny_ckpt, tmp_path / "src"))
    before = sorted(p.name for p in source.iterdir())
    for report, where in ((source, "is"), (source / "reports", "lies inside")):
        res = cli("eval", str(export), "-r", str(source), *EVAL, "--report", str(report))
        assert res.exit_code == 2, res.output
        assert f"--report {report} {where} the reference checkpoint {source}" in one_error_line(res)
    assert sorted(p.name for p in source.iterdir()) == before
    mine = tmp_path / "mine"
    kept = _user_folder(mine)
    res = cli("eval", str(export), "-r", str(source), *EVAL, "--report", str(mine))
    assert res.exit_code == 2 and "holds files salaquant did not write (notes.txt, sub/)" in one_error_line(res)
    assert _contents(mine) == kept


def test_eval_report_folders_that_are_accepted(export: Path, tmp_path: Path) -> None:
    from salaquant import __version__
    from salaquant.eval import EvalInputError
    from salaquant.eval.inputs import checked_report_dir
    from salaquant.eval.report import write_json

    new = tmp_path / "new" / "reports"
    assert checked_report_dir(new, export, SHIPPED) == new and new.is_dir()  # a new folder, made
    write_json({"salaquant": __version__}, new)
    assert checked_report_dir(new, export, SHIPPED) == new  # a folder of earlier eval reports
    mine = Path(shutil.copytree(export, tmp_path / "q"))
    assert checked_report_dir(mine, mine, SHIPPED) == mine  # the evaluated export, which salaquant wrote
    with pytest.raises(EvalInputError, match=f"is a checkpoint salaquant wrote, not the evaluated checkpoint {mine}"):
        checked_report_dir(export, mine, SHIPPED)  # another export
    with pytest.raises(EvalInputError, match="lies inside the evaluated checkpoint"):
        checked_report_dir(mine / "eval", mine, SHIPPED)


def test_eval_help_says_where_the_report_goes() -> None:
    res = cli("eval", "--help")
    assert res.exit_code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.output).split())
    assert "default: the checkpoint" not in text
    assert "(default: none, the report is only printed)" in text
