"""The GPTQ ``quantization_config`` (also ``quantize_config.json``) that vLLM, SGLang and transformers read."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ... import __version__
from ...model.config import SalaConfig
from ...model.layout import split_layer_name
from .dynamic import LinearPlan, build_dynamic


def quantization_config(
    config: SalaConfig, plan: dict[str, LinearPlan], group_size: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """The ``quantization_config`` / ``quantize_config.json`` dict: top-level bits = the most common bits;
    lm_head stays bf16 (no engine serves SALA with a quantized one: ``serving.LM_HEAD_REFUSAL``).

    ``dynamic`` (GPTQModel's per-module rules, read by SGLang, vLLM and GPTQModel) carries exclusions and
    per-module bits; ``modules_in_block_to_quantize`` lists the same quantized linears for the clients that
    ignore ``dynamic`` (transformers' GPTQ path through optimum)."""
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
    out["modules_in_block_to_quantize"] = modules_in_block(plan, config.num_hidden_layers)
    return out


def modules_in_block(plan: dict[str, LinearPlan], num_layers: int) -> list[list[str]]:
    """Per decoder layer, the full checkpoint names of its quantized linears, in name order.

    Full names because the readers match loosely: optimum replaces a linear whose name ends with a listed
    string and vLLM one whose name contains it, so in-block names (``self_attn.q_proj``) would also quantize
    the q/k/v that a minicpm4 layer keeps in bf16. A ``model.layers.{i}.`` prefix matches no other layer."""
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    for name, linear in plan.items():
        parts = split_layer_name(name)
        if linear.bits is not None and parts is not None:
            per_layer[parts[0]].append(name)
    return [sorted(names) for names in per_layer]
