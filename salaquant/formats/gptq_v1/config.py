"""The GPTQ ``quantization_config`` (also written as ``quantize_config.json``) that vLLM / SGLang read."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ... import __version__
from ...model.config import SalaConfig
from .dynamic import LinearPlan, build_dynamic


def quantization_config(
    config: SalaConfig, plan: dict[str, LinearPlan], group_size: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """The ``quantization_config`` / ``quantize_config.json`` dict: top-level bits = the most common bits;
    lm_head stays bf16 (no engine serves SALA with a quantized one: ``serving.LM_HEAD_REFUSAL``)."""
    counts = Counter(p.bits for p in plan.values() if p.bits is not None)
    if not counts:
        raise ValueError("the plan quantizes no linear: nothing to export as GPTQ")
    default_bits = counts.most_common(1)[0][0]
    dynamic = build_dynamic(plan, default_bits, group_size, config.num_hidden_layers)
    out: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": default_bits,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "lm_head": False,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"salaquant:{__version__}"], **meta},
    }
    if dynamic:
        out["dynamic"] = dynamic
    return out
