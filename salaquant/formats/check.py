"""Will SGLang / vLLM load this quantized folder with the intended kernels?

`check_checkpoint` reads ``config.json`` and the safetensors headers (plus the small tensors a format needs),
checks every tensor against the shapes ``config.json`` implies, and hands the folder to the checker of its
``quantization_config.quant_method`` (`CHECKERS`: each lives with its byte format). Every problem found is
collected; a `CheckError` lists them all, each naming the tensor (or config key) and the rule it breaks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..io.reader import CheckpointReader
from ..model.config import ConfigError, SalaConfig
from ..model.layout import parameter_shapes
from ..serving import serving_lines
from .gptq_v1.check import check_gptq
from .gptq_v1.check import shape_problems as gptq_shape_problems
from .modelopt_nvfp4.check import check_modelopt
from .modelopt_nvfp4.check import shape_problems as nvfp4_shape_problems
from .report import CheckError, CheckReport, fail

__all__ = ["CHECKERS", "CheckError", "CheckReport", "check_checkpoint", "config_problems"]

CHECKERS: dict[str, Callable[[CheckpointReader, dict[str, Any], int], CheckReport]] = {
    "gptq": check_gptq,
    "modelopt": check_modelopt,
}
"""The checker of each ``quantization_config.quant_method`` (each lives with its format)."""


def check_checkpoint(path: str | Path, tp: int = 1, served_as: str | Path | None = None) -> CheckReport:
    """Check the quantized checkpoint folder ``path`` for tensor-parallel size ``tp``.

    Raises `CheckError` listing every problem; returns a `CheckReport` otherwise, whose serving lines name
    ``served_as`` (where a checked export will be moved) or else ``path``.
    A folder that cannot be read (it is missing, or a file it needs is unreadable or corrupt) raises
    `CheckpointError` instead: bad input, not a checkpoint that fails the format's rules.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckError(f"tp={tp!r}: tensor-parallel size must be a positive integer")
    reader = CheckpointReader(path)
    config = reader.config()
    qconfig = config.get("quantization_config")
    if qconfig is None:
        raise CheckError(f"{Path(path) / 'config.json'}: no quantization_config (not a quantized checkpoint?)")
    if not isinstance(qconfig, dict):
        raise CheckError(f"{Path(path) / 'config.json'}: quantization_config is not a JSON object")
    method = qconfig.get("quant_method")
    checker = CHECKERS.get(method) if isinstance(method, str) else None
    if checker is None:
        known = ", ".join(sorted(CHECKERS))
        raise CheckError(f"unsupported quant_method {method!r} (checkers exist for: {known})")
    with reader:
        fail(config_problems(reader, config), f"{reader.path}: tensors against config.json")
        report = checker(reader, config, tp)
    report.serving = serving_lines(str(served_as if served_as is not None else path), method, tp)
    return report


def config_problems(reader: CheckpointReader, config: dict[str, Any]) -> list[str]:
    """Where the tensors disagree with the shapes ``config.json`` implies (a served model is built from the config,
    then filled from the tensors): every parameter of the SALA layout present, plain tensors with their shape,
    quantized ones as their format stores that shape (``shape_problems`` of each format)."""
    try:
        shapes = parameter_shapes(SalaConfig.from_dict(config))
    except ConfigError as exc:
        return [f"config.json: {exc}"]
    errors: list[str] = []
    for name, shape in shapes.items():
        stored = gptq_shape_problems(reader, name, shape)
        if stored is None:
            stored = nvfp4_shape_problems(reader, name, shape)
        if stored is not None:
            errors += stored
        elif name in reader:
            if tuple(reader.shape(name)) != shape:
                errors.append(f"{name}: shape {list(reader.shape(name))}, config.json implies {list(shape)}")
        else:
            errors.append(f"{name} is missing (config.json's layout has it)")
    return errors
