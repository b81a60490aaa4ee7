"""Data-parallel calibration: the fixed statistics tree, and ``torchrun`` with gloo on the shipped model.

Two processes give the bytes of one (GPTQ, NVFP4 with the input-scale search, the calibration statistics); a
process that fails ends the run with its message and no export, and the run resumes with another number of
processes to the same bytes. On a CPU the comparison holds for the same threads per process (CPU matrix products
split their sums by thread): ``torchrun`` gives each process one thread, so the single process runs with
``OMP_NUM_THREADS=1``, and each export records its ``cpu_threads``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from salaquant.calibration.distributed import assign
from salaquant.calibration.shards import TreeSum, owned_leaves, split_leaves
from salaquant.calibration.stats import GroupStats
from salaquant.nvfp4.input_scale import InputScaleSearch

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "sala-tiny"
CALIB = ROOT / "calib" / "sala-tiny-calib.jsonl"
DATA = ["--calib", str(CALIB), "--max-samples", "6", "--max-len", "192"]


def test_leaves_halve_by_tokens() -> None:
    """Recursive halving, longest first, each to the lighter half: worked by hand for these lengths."""
    lengths = [100, 10, 60, 50, 40, 30, 20, 5]
    # halves: 100, 40, 20 (160) | 60, 50, 30, 10, 5 (155); quarters: 100 | 40, 20 and 60, 10, 5 | 50, 30
    assert split_leaves(lengths, 4) == [[0], [4, 6], [1, 2, 7], [3, 5]]
    leaves = split_leaves(lengths)  # eight: one sample each here
    assert sorted(i for leaf in leaves for i in leaf) == list(range(8))
    assert split_leaves([7, 7], 8) == [[0], [], [], [], [1], [], [], []]
    assert list(owned_leaves(1, 2)) == [4, 5, 6, 7] and list(owned_leaves(3, 8)) == [3]
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        owned_leaves(0, 3)


def test_solves_go_to_the_least_loaded_process() -> None:
    """Costliest first, each to the process with the least cost so far (ties to the lower rank): by hand."""
    assert assign([5, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1]
    assert assign([1, 1, 1], 1) == [0, 0, 0]
    assert assign([2, 2, 2, 2], 4) == [0, 1, 2, 3]


def test_tree_sum_has_one_shape_for_any_split() -> None:
    """Pushed one by one or as the sums of two halves, eight values are added as ((0+1)+(2+3))+((4+5)+(6+7));
    values whose float sum depends on the order show it."""
    vals = [torch.tensor(v, dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0, 3.0, 1e-3, 7e7, -7e7)]

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    want = ((vals[0] + vals[1]) + (vals[2] + vals[3])) + ((vals[4] + vals[5]) + (vals[6] + vals[7]))
    sequential = vals[0]
    for v in vals[1:]:
        sequential = sequential + v
    assert not torch.equal(want, sequential)  # the example tells the orders apart
    one: TreeSum[torch.Tensor] = TreeSum(add)
    for v in vals:
        one.push(v)
    halves = []
    for part in (vals[:4], vals[4:]):
        t: TreeSum[torch.Tensor] = TreeSum(add)
        for v in part:
            t.push(v)
        halves.append(t.root())
    top: TreeSum[torch.Tensor] = TreeSum(add)
    for h in halves:
        top.push(h)
    assert torch.equal(one.root(), want) and torch.equal(top.root(), want)
    three: TreeSum[torch.Tensor] = TreeSum(add)
    for v in vals[:3]:
        three.push(v)
    with pytest.raises(ValueError, match="power of two"):
        three.root()


def test_merged_accumulators_equal_one_over_all_samples() -> None:
    """GroupStats and the input-scale search: the merge of two accumulators over two parts of the samples equals
    one accumulator over all of them (for two parts the plain sums make the same additions)."""
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(n, 16, generator=g) for n in (30, 50)]
    whole = GroupStats(16)
    parts = [GroupStats(16), GroupStats(16)]
    for s, part in zip(samples, parts, strict=True):
        for st in (whole, part):
            st.update(s)
            st.end_sample()
    merged = parts[0].merge(parts[1])
    for a, b in zip(merged.tensors()[:4], whole.tensors()[:4], strict=True):  # absmax, sumsq, counts, xtx
        assert torch.equal(a, b)
    # the per-sample sum adds x / n: one rounding in a fused multiply-add there, two in a merge
    torch.testing.assert_close(merged.xtx_per_sample, whole.xtx_per_sample, rtol=1e-6, atol=1e-7)
    assert merged.tokens == 80 and merged.samples == 2
    base = samples[0].abs().amax() / (6 * 448)
    one, left = InputScaleSearch(base), InputScaleSearch(base)
    right = left.fresh()
    for s in samples:
        one.update(s)
    left.update(samples[0])
    right.update(samples[1])
    left.merge(right)
    assert torch.equal(left.err2, one.err2) and torch.equal(left.counts, one.counts) and left.report()["tokens"] == 80
    assert left.best_factor() == one.best_factor()


def _env(nproc: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One process runs one thread; under torchrun the variable is left unset, as a user's shell leaves it, and
    torchrun sets it to 1 in each process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    if nproc > 1:
        env.pop("OMP_NUM_THREADS")
    return {**env, **(extra or {})}


def _salaquant(args: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "salaquant", *args]
    else:
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--nproc-per-node", str(nproc), "-m", "salaquant", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(nproc, env), check=False)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])


def _weights(folder: Path) -> dict[str, bytes]:
    files = sorted(folder.rglob("*.safetensors"))
    assert files, f"no safetensors under {folder}"
    return {str(f.relative_to(folder)): f.read_bytes() for f in files}


@pytest.mark.parametrize(
    "command",
    [
        ["gptq"],
        ["nvfp4", "--input-scale", "mse", "--mse-iters", "0"],
        ["calibrate", "--device", "cpu"],
    ],
    ids=["gptq", "nvfp4-mse", "calibrate"],
)
def test_two_processes_write_the_bytes_of_one(command: list[str], tmp_path: Path) -> None:
    args = [*command, "-i", str(SHIPPED), *DATA]
    _ok(_salaquant([*args, "-o", str(tmp_path / "one")]))
    _ok(_salaquant([*args, "-o", str(tmp_path / "two")], nproc=2))
    assert _weights(tmp_path / "two") == _weights(tmp_path / "one")
    if command[0] != "calibrate":
        report = json.loads((tmp_path / "two" / "quant_report.json").read_text())
        assert report["processes"] == 2 and sum(report["rank_tokens"]) == report["calibration"]["tokens"]
        assert min(report["rank_tokens"]) > 0 and "communicate" in report["timings_s"]
        one = json.loads((tmp_path / "one" / "quant_report.json").read_text())
        assert report["cpu_threads"] == one["cpu_threads"] == 1  # the condition the bytes hold under
    else:
        stats = load_file(tmp_path / "two" / "layers" / "001.safetensors")
        assert int(stats["mlp_in.counts"][1]) == 6  # every sample of both processes in the sums


def test_failed_process_ends_the_run_and_it_resumes_with_another_count(tmp_path: Path) -> None:
    """Rank 1 raising in layer index 5 stops both processes with its message; nothing is exported and the five
    finished layers (on a CPU each is a resume point) are kept; one process resumes them to the bytes of an
    uninterrupted run."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import salaquant.calibration.engine as engine\n"
        "    layer = engine.CalibrationEngine._layer\n"
        "    def failing(self, i, *args, **kwargs):\n"
        "        if i == 5:\n"
        "            raise RuntimeError('injected failure in layer 5')\n"
        "        return layer(self, i, *args, **kwargs)\n"
        "    engine.CalibrationEngine._layer = failing\n"
    )
    args = ["gptq", "--method", "rtn", "-i", str(SHIPPED), *DATA]
    out = tmp_path / "out"
    pythonpath = os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])
    failed = _salaquant([*args, "-o", str(out)], nproc=2, env={"PYTHONPATH": pythonpath})
    assert failed.returncode != 0
    assert "injected failure in layer 5" in failed.stdout + failed.stderr
    assert not out.exists() or not list(out.glob("*.safetensors"))
    state = json.loads((Path(f"{out}.work") / "state.json").read_text())
    assert state["finished"] == 5
    _ok(_salaquant([*args, "-o", str(out), "--resume"]))
    _ok(_salaquant([*args, "-o", str(tmp_path / "whole")]))
    assert _weights(out) == _weights(tmp_path / "whole")


def test_unserved_process_count_is_refused_before_any_work(tmp_path: Path) -> None:
    proc = _salaquant(["calibrate", "--device", "cpu", "-i", str(SHIPPED), *DATA, "-o", str(tmp_path / "o")], nproc=3)
    assert proc.returncode != 0 and "1, 2, 4 or 8" in proc.stdout + proc.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.work").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("command", [["gptq"], ["nvfp4", "--input-scale", "mse"]], ids=["gptq", "nvfp4-mse"])
def test_gpu_processes_write_the_bytes_of_one(command: list[str], tmp_path: Path) -> None:
    """On every GPU of the machine (NCCL) against one process on one GPU: the same shards."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two GPUs")
    nproc = 4 if n >= 4 else 2
    args = [*command, "--device", "cuda", "-i", str(SHIPPED), *DATA]
    _ok(_salaquant([*args, "-o", str(tmp_path / "one")]))
    _ok(_salaquant([*args, "-o", str(tmp_path / "many")], nproc=nproc))
    assert _weights(tmp_path / "many") == _weights(tmp_path / "one")
    report = json.loads((tmp_path / "many" / "quant_report.json").read_text())
    assert report["processes"] == nproc and all(p["gpu_gib"] is not None for p in report["rank_peaks"])
