"""What a long run shows: progress lines never further apart than the interval setting, what Ctrl-C keeps, and
counts of 16-bit linears that agree.

The progress tests slow one step down (a quantizer's solve, a NIAH prefill, a budget probe, a decode step, a
demo's quantize) to several times a short interval (``SALAQUANT_PROGRESS_SECONDS``), record when each line reaches
stderr, and check the longest silence against the interval.
"""

from __future__ import annotations

import io
import itertools
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from salaquant import outputs, progress
from salaquant.calibration.contract import EngineOptions, LayerResult
from salaquant.calibration.engine import CalibrationEngine
from salaquant.cli import app
from salaquant.work_folder import RunInterrupted, guarded_run

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
SMALL = ["--max-samples", "2", "--max-len", "64", "--device", "cpu"]
INTERVAL = 0.5  # seconds between lines asked of the heartbeat
SLOW = 5.0  # seconds of the slowed step: ten intervals, and more than twice the bound a line must meet
SLACK = 1.5  # a loaded 2-core machine's scheduling delay allowed on top of the interval
SETTING = "SALAQUANT_PROGRESS_SECONDS"  # the interval, seconds
runner = CliRunner()


class _Clocked(io.TextIOBase):
    """A stderr that records when each line arrives."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.perf_counter()
        self.lines += [(now, line) for line in text.splitlines() if line.strip()]
        return len(text)

    def isatty(self) -> bool:
        return False


def _listen(monkeypatch: pytest.MonkeyPatch) -> _Clocked:
    """The short interval set, and stderr recorded (in the test's body: pytest sets its own stderr after fixtures)."""
    monkeypatch.setenv(SETTING, str(INTERVAL))
    out = _Clocked()
    monkeypatch.setattr(sys, "stderr", out)
    return out


def _longest_silence(times: list[float], start: float, end: float) -> float:
    """The longest stretch of [start, end] with no line."""
    marks = [start, *sorted(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(marks))


def _assert_heard_through(lines: list[tuple[float, str]], start: float, end: float, words: str) -> None:
    """Lines at most INTERVAL (+ SLACK) apart over the slowed step [start, end], some saying ``words``."""
    assert end - start >= SLOW, "the step was not slowed"
    assert _longest_silence([t for t, _ in lines], start, end) <= INTERVAL + SLACK, lines
    inside = [text for t, text in lines if start <= t <= end]
    assert any(words in text for text in inside), inside


# ------------------------------------------------------------------------------------- the heartbeat


def test_a_phase_step_longer_than_the_interval_still_prints_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    clocked = _listen(monkeypatch)
    with progress.Phases(True) as phases, phases.phase("needle in a haystack", 2) as step:
        start = time.perf_counter()
        time.sleep(SLOW)
        end = time.perf_counter()
        step()
        step()
    _assert_heard_through(clocked.lines, start, end, "needle in a haystack: 0/2, still running")
    assert clocked.lines[-1][1].endswith("needle in a haystack: 2/2")


def test_the_interval_setting_defaults_to_30_s_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SETTING, raising=False)
    assert progress.line_seconds() == 30.0
    for bad in ("0", "-5", "soon", "nan"):
        monkeypatch.setenv(SETTING, bad)
        res = runner.invoke(app, ["inspect", str(SHIPPED)])
        assert res.exit_code == 2, res.output
        assert f"error: SALAQUANT_PROGRESS_SECONDS={bad!r}: expected a number of seconds above 0" in res.output


class _SlowQuantizer:
    """Scales every linear by 0.5; the solve of layer ``slow`` takes SLOW seconds, and Ctrl-C arrives in layer
    ``stop`` (None: never). ``seen`` lists the layers it quantized."""

    def __init__(self, slow: int | None = None, stop: int | None = None) -> None:
        self.slow, self.stop, self.seen = slow, stop, []
        self.window = (0.0, 0.0)

    def quantize_layer(self, index, layer, stats) -> LayerResult:
        if index == self.stop:
            raise KeyboardInterrupt
        self.seen.append(index)
        if index == self.slow:
            start = time.perf_counter()
            time.sleep(SLOW)
            self.window = (start, time.perf_counter())
        for p in layer.parameters():
            p.data.mul_(0.5)
        return LayerResult(layer=layer, tensors={"w": layer.mlp.up_proj.weight.detach().clone()})


def test_a_long_solve_in_the_calibration_engine_still_prints_lines(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clocked = _listen(monkeypatch)
    quantizer = _SlowQuantizer(slow=1)
    samples = [torch.arange(40) % 200 + 3]
    CalibrationEngine(tiny_ckpt, samples, tmp_path / "w", EngineOptions(device="cpu")).run(quantizer)
    _assert_heard_through(clocked.lines, *quantizer.window, "layer 2/4 (lightning) quantize, still running")


def test_a_long_niah_prefill_still_prints_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    clocked = _listen(monkeypatch)
    from salaquant.eval import command as eval_command
    from salaquant.eval.command import _continue_both
    from salaquant.eval.generation import Greedy
    from salaquant.eval.options import EvalOptions

    window: list[float] = []

    def slow_batch(model, prompts, *args, **kwargs):
        window.append(time.perf_counter())
        time.sleep(SLOW / 2)  # two lengths per model: the first model's two calls make one SLOW stretch
        window.append(time.perf_counter())
        return [Greedy([5, 6], None) for _ in prompts]

    class _Tokenizer:
        def decode(self, tokens, skip_special_tokens=True) -> str:
            return "x"

    monkeypatch.setattr(eval_command.gen, "continue_batch", slow_batch)
    prompts = [(64, torch.arange(64), 4), (128, torch.arange(128), 4)]
    with progress.Phases(True) as phases:
        _continue_both({"source": None}, _Tokenizer(), prompts, EvalOptions(), "needle in a haystack", phases)
    _assert_heard_through(clocked.lines, window[0], window[-1], "needle in a haystack: ")


def test_a_slow_budget_probe_still_prints_lines(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from salaquant.budget.search import BudgetSearch, SearchOptions, choose
    from salaquant.budget.size import parse_budget
    from salaquant.gptq.budget import gptq_units
    from salaquant.gptq.plan import BitsOptions, build_plan
    from salaquant.io.reader import CheckpointReader
    from salaquant.model.config import SalaConfig

    clocked = _listen(monkeypatch)
    reader = CheckpointReader(tiny_ckpt)
    config = SalaConfig.from_dict(reader.config())
    units = gptq_units(config, build_plan(config, BitsOptions()))
    window: list[float] = []

    def slow_probe(unit, option, layer):  # the first probe takes SLOW seconds; every option leaves the weights
        if not window:
            window.append(time.perf_counter())
            time.sleep(SLOW)
            window.append(time.perf_counter())
        return {m: layer.get_submodule(m).weight.data for m in unit.members}

    samples = [torch.arange(200) % 250 + 3]
    shown = Console(file=io.StringIO())  # a command's console: not quiet
    budget = parse_budget("6bits")
    choose(
        BudgetSearch(
            reader, config, samples, units, slow_probe, budget, SearchOptions(1, 32), torch.device("cpu"), shown
        )
    )
    _assert_heard_through(clocked.lines, window[0], window[1], "budget search: layers")


def test_a_slow_demo_quantize_step_still_prints_lines(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clocked = _listen(monkeypatch)
    from salaquant import demo

    window: list[float] = []

    class _Stop(Exception):
        pass

    def variants(*_args):
        def quantize(out: Path, console: Console) -> None:
            window.append(time.perf_counter())
            time.sleep(SLOW)
            window.append(time.perf_counter())
            raise _Stop

        return [("GPTQ W4A16", "gptq-w4a16", quantize)]

    monkeypatch.setattr(demo, "_variants", variants)
    monkeypatch.setattr(demo, "score_export", lambda *_args: {})  # the bf16 row's scores are not looked at
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path / "d", Console(quiet=True), quick=True, model=tiny_ckpt)
    _assert_heard_through(clocked.lines, window[0], window[1], "GPTQ W4A16: quantize, score: 0/2, still running")


def test_a_long_generation_prints_lines_on_stderr_and_only_its_text_on_stdout(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command as a pipe runs it, every decode step slowed: stderr hears from it at least every interval,
    stdout holds the completion alone."""
    from salaquant.runtime.decode import Decoder

    step = Decoder._step
    called: list[float] = []  # when each slowed step started: the window the heartbeat must cover

    def slow(self, state):
        called.append(time.perf_counter())
        time.sleep(0.5)  # even a generation ended early by its end token spans SLOW
        return step(self, state)

    monkeypatch.setattr(Decoder, "_step", slow)
    clocked = _listen(monkeypatch)
    stdout = _Clocked()
    monkeypatch.setattr(sys, "stdout", stdout)
    args = ["generate", str(tiny_ckpt), "--prompt", "The king", "--max-new-tokens", "20", "--device", "cpu"]
    app(args, standalone_mode=False)
    steps = [t for t, text in clocked.lines if "salaquant generate: started; token " in text]
    assert len(steps) >= 4, clocked.lines  # nineteen slowed steps: 9.5 s
    _assert_heard_through(clocked.lines, called[0], called[-1], "token ")
    assert [text for _, text in stdout.lines] == [stdout.lines[0][1]] and stdout.lines[0][1].startswith("The king")


# ------------------------------------------------------------------------------------- what Ctrl-C keeps


def _interrupted_engine(model: Path, work: Path, stop: int, every: int | None) -> str:
    opts = EngineOptions(device="cpu", show_progress=False, resume_every=every)
    engine = CalibrationEngine(model, [torch.arange(40) % 200 + 3], work, opts)
    with pytest.raises(RunInterrupted) as caught, guarded_run(work, resume=False, overwrite=False):
        engine.run(_SlowQuantizer(stop=stop))
    return str(caught.value)


@pytest.fixture(scope="module")
def interrupted_then_resumed(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``gptq`` of the tiny checkpoint stopped by Ctrl-C after "layer 2/4 done" (on a CPU), then resumed: both
    outputs, the work folder's state between them, and the layers each run solved."""
    import salaquant.gptq.command as command

    out = tmp_path_factory.mktemp("ctrl_c") / "q"
    args = ["gptq", "-i", str(tiny_ckpt), "-o", str(out), "--calib", CALIB, *SMALL, "--method", "rtn"]
    solve = command.GPTQLayerQuantizer.quantize_layer
    seen: list[int] = []
    stop = [2]

    def recorded(self, index, layer, stats):
        if index in stop:
            stop.clear()
            raise KeyboardInterrupt
        seen.append(index)
        return solve(self, index, layer, stats)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(command.GPTQLayerQuantizer, "quantize_layer", recorded)
        first = runner.invoke(app, args)
        kept = outputs.work_dir_for(out) / "state.json"
        state = json.loads(kept.read_text()) if kept.exists() else None
        solved_first = list(seen)
        second = runner.invoke(app, [*args, "--resume"])
    return {
        "out": out,
        "first": first,
        "second": second,
        "state": state,
        "seen": (solved_first, seen[len(solved_first) :]),
    }


def test_ctrl_c_on_a_cpu_keeps_every_finished_layer_and_resume_continues_after_it(
    interrupted_then_resumed: dict,
) -> None:
    run = interrupted_then_resumed
    out, first, second = run["out"], run["first"], run["second"]
    assert first.exit_code == 130, first.output
    assert (
        f"interrupted: layers 1-2 of 4 are kept in {outputs.work_dir_for(out)}: rerun the same command with --resume "
        "to continue from layer 3, or with --overwrite to start over" in " ".join(first.output.split())
    )
    assert "computed again" not in first.output and run["state"] is not None and run["state"]["finished"] == 2
    assert second.exit_code == 0, second.output
    assert run["seen"] == ([0, 1], [2, 3])  # the resumed run solved layers 3 and 4 only
    assert (out / "model.safetensors").exists() and not outputs.work_dir_for(out).exists()


def test_ctrl_c_between_resume_points_says_where_resume_starts(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Resume points every 2 layers (as on a GPU, every 4): the message names the layer a resumed run starts at and
    says that the layer finished after it is computed again; before the first point nothing is kept, and it says
    why."""
    work = tmp_path / "w"
    said = _interrupted_engine(tiny_ckpt, work, stop=3, every=2)  # layers 1-3 finished, a resume point after 2
    assert said == (
        f"interrupted: layers 1-2 of 4 are kept in {work}: rerun the same command with --resume to continue from "
        "layer 3, or with --overwrite to start over (the hidden states are saved after every 2 layers on this "
        "device: any layer finished after layer 2 is computed again)"
    )
    assert json.loads((work / "state.json").read_text())["finished"] == 2
    work = tmp_path / "w1"
    said = _interrupted_engine(tiny_ckpt, work, stop=1, every=2)  # layer 1 finished, no resume point yet
    assert said == (
        f"interrupted: nothing was kept ({work} removed): the hidden states are saved after every 2 layers on this "
        "device, and no such point was reached"
    )
    assert not work.exists()


# ------------------------------------------------------------------------------------- counts that agree


def test_gptq_and_check_count_the_16_bit_linears_alike(tiny_ckpt: Path, interrupted_then_resumed: dict) -> None:
    from salaquant.gptq.plan import BitsOptions, build_plan, marlin_exclusions
    from salaquant.model.config import SalaConfig

    config = SalaConfig.from_dict(json.loads((tiny_ckpt / "config.json").read_text()))
    kept = len(marlin_exclusions(config, build_plan(config, BitsOptions()), 1))
    assert kept == 6  # the minicpm4 layers' k/v projections (8 rows) and their fused q, two layers
    said = " ".join(interrupted_then_resumed["first"].output.split())
    assert f"keeping {kept} decoder linears in bf16 (lm_head, never quantized, is kept too): gptq_marlin" in said
    res = runner.invoke(app, ["check", str(interrupted_then_resumed["out"])])
    assert res.exit_code == 0, res.output
    assert f"{kept + 1} kept in 16 bits (lm_head and {kept} decoder linears)" in " ".join(res.output.split())
