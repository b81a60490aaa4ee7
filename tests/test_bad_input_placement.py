"""Where a run leaves its output, and advice that works: nothing that fails a check stands at ``-o``, inputs that
would fail at the end are refused before any model work, and each piece of advice a refusal gives succeeds when
followed.

Each test drives the command line the way a user would, checks the refusal against what the input is (the flag,
key, path or setting it names, the exit status, what is left on disk), then follows the advice where there is one.
Faults a CI machine cannot produce (a full disk, a bug in the writer) are injected at the call that meets them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from cli_checks import SMALL, cli, one_error_line, text
from lock_holder import lock_held
from safetensors import safe_open
from shipped import CALIB

from salaquant import outputs
from salaquant.formats.report import CheckError

RECIPE_SMALL = [
    *("--set", "calibration.max_samples=2", "--set", "calibration.max_len=64", "--set", "engine.device=cpu"),
    *("--set", "eval.seq_len=32", "--set", "eval.windows=1", "--set", "eval.max_kl=10"),
]


def _gptq(model: Path, out: Path, *extra: str, calib: str = CALIB):
    return cli("gptq", "-i", str(model), "-o", str(out), "--calib", calib, *SMALL, *extra)


def _beside(out: Path) -> list[str]:
    """Everything named after ``out`` in its folder: the output and what a run derives from it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.lstrip(".").startswith(out.name))


def _interrupt_export(monkeypatch, model: Path, out: Path, *extra: str) -> None:
    """A run whose every layer is calibrated, stopped by Ctrl-C while its export is written."""
    import salaquant.driver as command  # the pipeline every method's command runs

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(command, "export_checkpoint", interrupted)
        res = _gptq(model, out, *extra)
    assert res.exit_code == 130 and (outputs.work_dir_for(out) / "state.json").exists(), res.output


@pytest.fixture()
def model(tiny_ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))


# ------------------------------------------------------------------------------------- exports in bf16, checked first


def _dtypes(folder: Path) -> dict[str, str]:
    """Every tensor's dtype as the safetensors header states it (``BF16``, ``F32``, ...)."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_an_fp32_or_fp16_source_gives_a_bf16_export_that_passes_the_check(dtype: str, tmp_path: Path) -> None:
    from salaquant.model.tiny import preset_config, write_random_checkpoint

    source = tmp_path / dtype
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    write_random_checkpoint(source, preset_config("tiny"), seed=1, std=0.05, dtype=torch_dtype)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "torch_dtype": str(torch_dtype)[6:]}))
    out = tmp_path / "q"
    res = _gptq(source, out)
    assert res.exit_code == 0, res.output
    stored = _dtypes(out)
    plain = {n: d for n, d in stored.items() if d not in ("I32", "U8") and not n.endswith(".scales")}
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= plain.keys()
    assert set(plain.values()) == {"BF16"}, plain  # no float32 or float16 tensor left unquantized
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    check = cli("check", str(out))
    assert check.exit_code == 0, check.output


def _longest_name_allowed(folder: Path) -> int:
    """The longest output name that leaves room for the longest name written beside it: the backup made when an
    older OUT.check-failed is replaced (process id up to 7 digits, 8 random characters)."""
    longest = f".NAME.check-failed.old-{'9' * 7}-{'x' * 8}"
    return os.pathconf(folder, "PC_NAME_MAX") - (len(longest) - len("NAME"))


def test_an_export_failing_the_format_check_is_kept_beside_the_output(model: Path, tmp_path: Path, monkeypatch) -> None:
    import salaquant.formats.check as check

    def broken(reader, config, tp):
        raise CheckError("1 problem(s)", ["lm_head.weight: dtype torch.float32, expected bfloat16 or float16"])

    out = tmp_path / ("q" * _longest_name_allowed(tmp_path))  # every name written beside it at its longest
    failed = Path(f"{out}.check-failed")
    monkeypatch.setitem(check.CHECKERS, "gptq", broken)
    for _ in range(2):  # the second replaces the first's OUT.check-failed
        res = _gptq(model, out)
        assert res.exit_code == 2, res.output
        line = one_error_line(res)
        assert "the export fails the format check" in line and f"kept at {failed}" in line and "not written" in line
        assert "lm_head.weight: dtype torch.float32" in res.output
        assert "--resume" not in res.output  # a rerun would write the same export: no advice that loops
        assert _beside(out) == [failed.name]  # no output, work folder or staging folder
        assert (failed / "model.safetensors").exists() and (failed / "quant_report.json").exists()
    monkeypatch.undo()
    res = _gptq(model, out)  # the same command, once the cause is gone, needs no flag
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").exists() and not outputs.work_dir_for(out).exists()


# ------------------------------------------------------------------------------------- refused before any model work


def test_a_tp_the_model_cannot_take_is_refused_before_the_data_is_read(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    missing = str(tmp_path / "no-such-calib.jsonl")  # never reached
    res = _gptq(model, out, "--tp", "3", calib=missing)
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert "--tp 3" in line and "16 heads of size 8 do not split over tp=3" in line  # the tiny model's q_proj
    assert "that split every layer: 1, 2, 4" in line
    res = _gptq(model, out, "--tp", "4", "--exclude", r"mlp\.(gate|up)_proj", calib=missing)
    assert res.exit_code == 2, res.output
    assert "--tp 4: gptq_marlin cannot serve any linear the plan quantizes" in one_error_line(res)
    assert _beside(out) == []
    res = _gptq(model, out, "--tp", "4")  # a size the message lists
    assert res.exit_code == 0, res.output
    assert cli("check", str(out), "--tp", "4").exit_code == 0


def test_an_output_name_too_long_for_what_is_written_beside_it(model: Path, tmp_path: Path) -> None:
    fits = _longest_name_allowed(tmp_path)  # a run with that name: the format check test above
    out = tmp_path / ("n" * (fits + 1))
    res = _gptq(model, out, calib=str(tmp_path / "no-such-calib.jsonl"))
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"allows {os.pathconf(tmp_path, 'PC_NAME_MAX')}: choose a name of at most {fits} bytes" in line
    assert _beside(out) == []


def test_a_second_run_while_the_first_is_active_is_told_its_pid(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    work = outputs.work_dir_for(out)
    work.mkdir()
    (work / "state.json").write_text(json.dumps({"finished": 0, "num_layers": 4}))  # as a first run writes it
    with lock_held(work) as holder:
        for flags in ((), ("--resume",), ("--overwrite",)):
            res = _gptq(model, out, *flags)
            assert res.exit_code == 2, res.output
            line = one_error_line(res)
            assert f"another salaquant run (pid {holder.pid}) is using {work}" in line and "rerun" not in line
    assert (work / "state.json").exists()  # the running one's folder was left alone


def test_free_space_is_checked_before_the_data_is_read(model: Path, tmp_path: Path, monkeypatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda _p: usage._replace(free=500))
    res = _gptq(model, tmp_path / "q", calib=str(tmp_path / "no-such-calib.jsonl"))
    assert res.exit_code == 2, res.output
    assert f"not enough free space for {tmp_path / 'q'}" in one_error_line(res)
    assert _beside(tmp_path / "q") == []


def test_resume_after_a_full_disk_counts_only_what_is_left(model: Path, tmp_path: Path, monkeypatch) -> None:
    from salaquant.model.config import SalaConfig
    from salaquant.summary import summarize

    out = tmp_path / "q"
    _interrupt_export(monkeypatch, model, out)  # every layer is in the work folder: only the export is left
    export = summarize(SalaConfig.from_dict(json.loads((model / "config.json").read_text()))).sizes["w4a16"]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda _p: usage._replace(free=export * 5 // 4))
    res = _gptq(model, out, "--resume")  # room for the export and a quarter more
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------------- advice that works


def test_resume_with_other_settings_names_them_and_both_ways_out_work(model: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "q"
    _interrupt_export(monkeypatch, model, out)
    res = _gptq(model, out, "--resume", "--damp", "0.05")
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert "gptq.damp 0.01, now 0.05" in line and "rerun with --overwrite instead of --resume" in line
    assert "rerun the same command" not in line
    work = outputs.work_dir_for(out)
    shutil.copytree(work, tmp_path / "kept")
    assert _gptq(model, out, "--resume").exit_code == 0  # with what it was written with
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "kept", work)  # the same unfinished run again
    res = _gptq(model, out, "--overwrite", "--damp", "0.05")  # or start over
    assert res.exit_code == 0, res.output
    assert json.loads((out / "salaquant_settings.json").read_text())["gptq"]["damp"] == 0.05


def test_gate_data_is_read_before_any_model_work(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    gate = ["run", "rtn-w4a16", "-i", str(model), "-o", str(out), "--calib", CALIB, *RECIPE_SMALL]
    res = cli(*gate, "--set", f"eval.data={tmp_path / 'nope.jsonl'}")
    assert res.exit_code == 2, res.output
    assert _beside(out) == [] and "layer" not in res.output  # no OUT.gate-pending, no work: nothing was run
    assert f"eval.data: {tmp_path / 'nope.jsonl'}" in one_error_line(res)
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "short"}\n')
    res = cli(*gate, "--set", f"eval.data={short}")
    assert res.exit_code == 2, res.output
    assert f"eval.data {short}" in one_error_line(res) and "fewer than eval.seq_len=32" in text(res)
    assert _beside(out) == []


def test_a_gate_that_cannot_run_leaves_nothing_pending_and_resume_finishes(
    model: Path, tmp_path: Path, monkeypatch
) -> None:
    import salaquant.run_recipe as run_recipe

    out = tmp_path / "with space" / "q $x"
    out.parent.mkdir()
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(Path(CALIB).read_text().splitlines(keepends=True)[:2]))
    gate = ["run", "rtn-w4a16", "-i", str(model), "-o", str(out), "--calib", CALIB, *RECIPE_SMALL]
    gate += ["--set", f"eval.data={data}"]
    real = run_recipe.eval_gate

    def broken(*_args, **_kwargs):
        raise RuntimeError("out of memory while scoring")

    monkeypatch.setattr(run_recipe, "eval_gate", broken)
    res = cli(*gate)
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    work = outputs.work_dir_for(out)
    assert "out of memory while scoring" in line and f"kept in {work}" in line and "rerun with --resume" in line
    assert _beside(out) == [work.name]  # no OUT.gate-pending, no export at -o, no staging folder
    monkeypatch.setattr(run_recipe, "eval_gate", real)
    res = cli(*gate, "--resume")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "eval_gate.json").read_text())["passed"] and _beside(out) == [out.name]
    serve = next(line for line in res.output.splitlines() if line.startswith("serve: "))
    assert shlex.split(serve)[shlex.split(serve).index("--model-path") + 1] == str(out)  # one word, the final -o
