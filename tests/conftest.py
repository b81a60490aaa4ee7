from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on machines without a GPU; this must be set before any kernel
# module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from salaquant.model.tiny import preset_config, write_random_checkpoint


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


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_ckpt_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint stored in fp32, for comparisons that bf16 rounding would blur."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny_fp32"
    return write_random_checkpoint(out, preset_config("tiny"), seed=1, std=0.05, dtype=torch.float32)
