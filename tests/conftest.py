from __future__ import annotations

import contextlib
import copy
import os
import random
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on machines without a GPU; this must be set before any kernel
# module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from salaquant.cpu_gemm import bf16_linears_in_fp32
from salaquant.model.tiny import preset_config, write_random_checkpoint

# Under pytest-xdist each worker takes one core of its own: torch's default of one thread per core in every
# worker would oversubscribe the machine (the CPU suite runs as `pytest -n 2`). The processes a test starts (the
# commands, torchrun) inherit the limit through OMP_NUM_THREADS: with two OpenMP threads each beside the other
# worker, the spinning threads made one export fixture 7x slower on a 2-core machine (758 s against 109 s).
if os.environ.get("PYTEST_XDIST_WORKER") and (os.cpu_count() or 1) <= int(os.environ["PYTEST_XDIST_WORKER_COUNT"]):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# The tests compute as the commands do on this machine (`salaquant.cli.app` enters the same context for every
# command): bf16 linears through float32 on a CPU without bf16 arithmetic, in library calls made here too. The
# stack holds the context for the whole session (an unreferenced one would be closed when collected).
_SESSION = contextlib.ExitStack()
_SESSION.enter_context(bf16_linears_in_fp32())


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CI-size random SALA checkpoint (bf16 on disk, like a real one)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return write_random_checkpoint(out, preset_config("tiny"), seed=1, std=0.05)


@pytest.fixture(scope="session")
def tiny_ckpt_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like ``tiny_ckpt`` but with RoPE on the minicpm4 layers too (attn_use_rope=true)."""
    cfg = copy.deepcopy(preset_config("tiny"))
    cfg["attn_use_rope"] = True
    out = tmp_path_factory.mktemp("ckpt") / "tiny_rope"
    return write_random_checkpoint(out, cfg, seed=2, std=0.05)


def small_nvfp4_export(source: Path, out: Path) -> Path:
    """An NVFP4 export of ``source`` from one 64-token calibration sample, no scale search (quick on a CPU)."""
    from rich.console import Console

    from salaquant.calibration.calib_data import CalibOptions
    from salaquant.driver import run_method
    from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
    from salaquant.nvfp4.layer import NVFP4LayerOptions

    return run_method(
        source,
        out,
        [str(Path(__file__).resolve().parents[1] / "calib" / "sala-tiny-calib.jsonl")],
        CalibOptions(max_samples=1, max_len=64),
        NVFP4Method(NVFP4LayerOptions(mse_iters=0), NVFP4RunOptions(device="cpu", show_progress=False)),
        Console(quiet=True),
    )


@pytest.fixture(scope="session")
def shipped_rtn_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A W4 g128 round-to-nearest GPTQ export of the shipped model (2 calibration samples of 128 tokens)."""
    from rich.console import Console

    from salaquant.calibration.calib_data import CalibOptions
    from salaquant.driver import run_method
    from salaquant.gptq.command import GPTQMethod, RunOptions
    from salaquant.gptq.layer import GPTQLayerOptions
    from salaquant.gptq.plan import BitsOptions

    root = Path(__file__).resolve().parents[1]
    return run_method(
        root / "models" / "sala-tiny",
        tmp_path_factory.mktemp("shipped") / "w4",
        [str(root / "calib" / "sala-tiny-calib.jsonl")],
        CalibOptions(max_samples=2, max_len=128),
        GPTQMethod(BitsOptions(), GPTQLayerOptions(method="rtn"), RunOptions(device="cpu", show_progress=False)),
        Console(quiet=True),
    )


def _fresh_seed() -> int:
    """``SALAQUANT_TEST_SEED`` when set (to replay a failure), else a new seed from the system's entropy."""
    env = os.environ.get("SALAQUANT_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.fixture(autouse=True)
def rng_seed(request: pytest.FixtureRequest) -> int:
    """Seed of torch's global generator for this test (``torch.initial_seed()`` reads it back).

    Tests marked ``random_inputs`` (the kernel tests) draw fresh random inputs on every run and print the seed,
    which the failure report shows with the captured output; the other tests use seed 0 (their expected values
    come from trained or shipped files as well as from references).
    """
    seed = _fresh_seed() if request.node.get_closest_marker("random_inputs") else 0
    if seed:
        print(f"random inputs from seed {seed}; SALAQUANT_TEST_SEED={seed} replays them")
    torch.manual_seed(seed)
    return seed


@pytest.fixture(scope="session")
def tiny_ckpt_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint stored in fp32, for comparisons that bf16 rounding would blur."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny_fp32"
    return write_random_checkpoint(out, preset_config("tiny"), seed=1, std=0.05, dtype=torch.float32)


@pytest.fixture(scope="session")
def fp32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny SALA checkpoint in fp32 (fast on any CPU) with the shipped model's tokenizer."""
    out = tmp_path_factory.mktemp("fp32") / "model"
    write_random_checkpoint(out, preset_config("tiny", vocab_size=4096), seed=3, std=0.05, dtype=torch.float32)
    for f in (Path(__file__).resolve().parents[1] / "models" / "sala-tiny").glob("*token*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


# The files that take longest on the 2-core CPU machine, longest first. pytest-xdist hands a worker one whole file
# at a time in collection order (`--dist loadfile --no-loadscope-reorder`): starting these first keeps every core
# busy to the end instead of leaving one file of minutes running alone.
LONGEST_FIRST = (
    "test_distributed.py",
    "test_demo.py",
    "test_quality_smoke.py",
    "test_eval.py",
    "test_kernels_infllm.py",
    "test_sglang.py",
    "test_nvfp4_e2e.py",
    "test_recipes.py",
    "test_shipped_model.py",
    "test_gptq_e2e.py",
    "test_decode_benchmark.py",
    "test_lm_eval.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the longest files first (`LONGEST_FIRST`; the rest keep their order), and skip what the machine cannot
    run, by marker (registered in pyproject.toml).

    ``gpu`` tests need CUDA and run without ``TRITON_INTERPRET=1`` (full SALA shapes, far too slow interpreted);
    ``interpreter`` tests run Triton on CPU tensors, which only the interpreter does: on a CUDA machine they run
    with ``TRITON_INTERPRET=1``, so each run there takes one side. Machines without CUDA always interpret.
    """
    del config
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file stays
    cuda = torch.cuda.is_available()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
            elif interpreting:
                item.add_marker(pytest.mark.skip(reason="GPU test at full size: run it without TRITON_INTERPRET=1"))
        if item.get_closest_marker("interpreter") is not None and cuda and not interpreting:
            item.add_marker(pytest.mark.skip(reason="Triton on CPU tensors: run it with TRITON_INTERPRET=1"))
