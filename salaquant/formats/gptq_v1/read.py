"""Read a GPTQ v1 linear back as a dense weight (the dequantized values the serving kernels compute with)."""

from __future__ import annotations

from typing import Any

import torch

from ...io.files import CheckpointError
from ...io.reader import CheckpointReader
from .dynamic import plan_for
from .packing import dequantize_gptq_v1

GPTQ_KEYS = ("qweight", "qzeros", "scales", "g_idx")


def dequantized_weight(
    reader: CheckpointReader,
    module: str,
    qconfig: dict[str, Any],
    shape: tuple[int, ...],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``module`` (e.g. ``model.layers.3.mlp.down_proj``) as a bfloat16 weight of ``shape`` [out, in], decoded on
    ``device`` (the packed tensors are an eighth of the weight's bytes to move)."""
    plan = plan_for(qconfig.get("dynamic") or {}, module, int(qconfig["bits"]), int(qconfig["group_size"]))
    if plan.bits is None:
        raise CheckpointError(f"{module}: has GPTQ tensors but quantization_config.dynamic excludes it")
    tensors = {k: reader.get(f"{module}.{k}", device=device) for k in GPTQ_KEYS}
    w = dequantize_gptq_v1(tensors, plan.bits)
    if tuple(w.shape) != tuple(shape):
        raise CheckpointError(f"{module}: GPTQ tensors decode to shape {list(w.shape)}, expected {list(shape)}")
    return w.to(torch.bfloat16)
