"""The CPU-memory plan of a calibration run and the check against the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import salaquant.calibration.host_memory as hm
from salaquant.calibration.contract import EngineOptions
from salaquant.calibration.engine import CalibrationEngine
from salaquant.cli import app

GIB = 2**30


def test_plan_hand_computed() -> None:
    # one 131,073-token sample and two of 8,193 at hidden size 4096 in bf16: 147,459 x 8,192 bytes
    h = 147_459 * 4096 * 2
    pinned = hm.plan_host_memory([131_073, 8_193, 8_193], 4096, 2, sets=1, pinned=True, layer_bytes=600_000_000)
    assert pinned.hidden_bytes == h == 1_207_984_128
    assert pinned.buffer_bytes == 2 * GIB  # the next power of two
    assert pinned.total_bytes == 2 * GIB + 600_000_000
    pageable = hm.plan_host_memory([131_073, 8_193, 8_193], 4096, 2, sets=2, pinned=False, layer_bytes=0)
    assert pageable.buffer_bytes == 2 * h
    exact = hm.plan_host_memory([131_072], 4096, 2, sets=1, pinned=True, layer_bytes=0)
    assert exact.buffer_bytes == GIB  # already a power of two
    with pytest.raises(ValueError, match="sets"):
        hm.plan_host_memory([1], 8, 2, sets=3, pinned=False, layer_bytes=0)


def test_meminfo_parsing(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32768000 kB\nMemFree:  100 kB\nMemAvailable:   16384000 kB\n")
    assert hm.meminfo(f) == (16_384_000 * 1024, 32_768_000 * 1024)
    f.write_text("MemTotal:       32768000 kB\n")
    assert hm.meminfo(f) is None
    assert hm.meminfo(tmp_path / "missing") is None


def test_process_memory_parsing(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1536 kB\nRssFile:\t 12 kB\nThreads:\t4\n")
    assert hm.process_memory(path=status) == 1536 * 1024
    assert hm.process_memory("RssFile", status) == 12 * 1024
    assert hm.process_memory("VmHWM", status) == 2048 * 1024
    assert hm.process_memory("VmSwap", status) is None  # no such line
    assert hm.process_memory(path=tmp_path / "missing") is None


def test_check_refuses_warns_or_passes() -> None:
    plan = hm.plan_host_memory([131_072], 4096, 2, sets=1, pinned=True, layer_bytes=GIB // 2)  # 1.5 GiB
    with pytest.raises(hm.HostMemoryError, match=r"about 1\.5 GiB.*has 1\.0 GiB of memory; use fewer"):
        hm.check_host_memory(plan, lambda: (GIB, GIB), advice="use fewer")
    warning = hm.check_host_memory(plan, lambda: (GIB, 4 * GIB))
    assert warning is not None and "1.0 GiB are available now (of 4.0 GiB)" in warning
    assert hm.check_host_memory(plan, lambda: (2 * GIB, 4 * GIB)) is None
    assert hm.check_host_memory(plan, lambda: None) is None


def test_engine_plans_its_largest_layer_and_refuses_early(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = [torch.randint(0, 264, (n,)) for n in (100, 50)]
    engine = CalibrationEngine(tiny_ckpt, samples, tmp_path / "w", EngineOptions(device="cpu", show_progress=False))
    # the largest layer, summed from the tensors themselves
    per_layer: dict[str, int] = {}
    for shard in tiny_ckpt.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if name.startswith("model.layers."):
                    t = f.get_tensor(name)
                    key = name.split(".")[2]
                    per_layer[key] = per_layer.get(key, 0) + t.numel() * t.element_size()
    assert engine._largest_layer_bytes() == max(per_layer.values())
    monkeypatch.setattr(hm, "meminfo", lambda: (1024, 2048))
    with pytest.raises(hm.HostMemoryError, match="calibration needs"):
        engine.run()
    assert not (tmp_path / "w" / "hidden").exists()  # refused before any layer ran


def test_gptq_command_reports_the_shortfall(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hm, "meminfo", lambda: (1024, 2048))
    calib = Path(__file__).resolve().parents[1] / "calib" / "sala-tiny-calib.jsonl"
    args = ["gptq", "-i", str(tiny_ckpt), "-o", str(tmp_path / "out"), "--calib", str(calib), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0
    assert "calibration needs" in res.output and "--max-samples" in res.output


def test_empty_pinned_cache_falls_back_to_the_private_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False)
    assert hm.empty_pinned_cache() is True
    assert calls == ["private"]
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("public"), raising=False)
    assert hm.empty_pinned_cache() is True
    assert calls == ["private", "public"]  # the public call when the build has it, and only that one
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    assert hm.empty_pinned_cache() is False


@pytest.mark.gpu
def test_gpu_pinned_memory_returns_to_the_system_after_release(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The engine's hidden states are pinned: after ``release()`` the process must not keep them resident."""
    ids = [torch.randint(0, 200, (1, 4096)) for _ in range(96)]
    engine = CalibrationEngine(tiny_ckpt, ids, tmp_path / "work", EngineOptions(device="cuda"))
    engine.run(None)
    assert engine.final_hidden is not None
    held = sum(h.numel() * h.element_size() for h in engine.final_hidden)
    assert held >= 64 * 2**20
    # measured around release() alone: CUDA's context and the libraries loaded by the run stay resident either way
    during = hm.process_memory()
    engine.release()
    assert engine.final_hidden is None
    after = hm.process_memory()
    assert during is not None and after is not None
    assert during - after > held / 2  # the pinned block went back to the system, not into PyTorch's cache
