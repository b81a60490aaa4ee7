"""The NVFP4 configs ModelOpt writes: ``hf_quant_config.json`` (nested) and the flat ``quantization_config``."""

from __future__ import annotations

from typing import Any

from ... import __version__

GROUP_SIZE = 16


def hf_quant_config(exclude_modules: list[str]) -> dict[str, Any]:
    if not exclude_modules:
        raise ValueError("exclude_modules must not be empty (some SGLang versions reject an empty list)")
    return {
        "producer": {"name": "salaquant", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": exclude_modules,
        },
    }


def flat_quantization_config(exclude_modules: list[str]) -> dict[str, Any]:
    """``config.json`` ``quantization_config`` in the flat form newer vLLM / SGLang read."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "producer": {"name": "salaquant", "version": __version__},
        "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
        "ignore": list(exclude_modules),
        "exclude_modules": list(exclude_modules),
        "group_size": GROUP_SIZE,
        "kv_cache_quant_algo": None,
        "kv_cache_scheme": None,
    }
