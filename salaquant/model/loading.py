"""Build SALA modules from a checkpoint folder: the whole model, or one decoder layer at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..io.files import CheckpointError
from ..io.reader import CheckpointReader
from .config import SalaConfig
from .layout import derived_tensor, global_parameter_shapes, layer_parameter_shapes, parameter_shapes
from .modeling import DecoderLayer, SalaForCausalLM

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _nonfinite_message(reader: CheckpointReader, name: str, count: int, first: list[int]) -> str:
    file = reader.path / reader.shard_of(name) if name in reader else reader.path
    return f"{file}: tensor {name} holds NaN or Inf ({count} value(s), the first at {first}): the checkpoint is damaged"


def require_finite(reader: CheckpointReader, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (read as ``name``) unchanged, or a `CheckpointError` naming it and its first NaN/Inf entry.
    The loaders of whole checkpoints (``generate``, ``eval``, the eval gate) check every tensor they read."""
    if not tensor.is_floating_point():
        return tensor
    values = tensor if tensor.dtype.itemsize > 1 else tensor.float()  # float8: isfinite needs a wider type
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(_nonfinite_message(reader, name, int(bad.sum()), where))
    return tensor


SCAN_BLOCK_BYTES = 64 * 2**20
"""Bytes `check_finite` reads at a time: its memory, whatever the size of a tensor."""
SCAN_PROGRESS_BYTES = 2 * 10**9
"""Checkpoints from this size on show `check_finite`'s progress (a few seconds of reading and more)."""


def check_finite(reader: CheckpointReader) -> None:
    """Refuse a checkpoint with a NaN or Inf in a floating tensor, naming the first such tensor (in file order),
    its count of bad values and the index of the first.

    The quantizers run this before the calibration data is read, so a damaged weight of the last layer fails
    the run in seconds instead of after every layer before it. Tensors are read in file order, in blocks of
    `SCAN_BLOCK_BYTES` into one buffer (memory stays at that size). A block's minimum and maximum, which NaN
    and Inf propagate into, is the fast test; only a block that fails it is searched for the bad values."""
    from ..progress import Phases
    from ..summary import human_bytes

    names = [n for n in reader if reader.dtype(n).is_floating_point]
    names.sort(key=lambda n: (reader.shard_of(n), reader.offset(n)))
    total = sum(reader.nbytes(n) for n in names)
    buffer = torch.empty(SCAN_BLOCK_BYTES, dtype=torch.uint8)
    what = f"checking {human_bytes(total)} of weights for NaN/Inf"
    with Phases(enabled=total >= SCAN_PROGRESS_BYTES) as phases, phases.phase(what, len(names)) as step:
        for name in names:
            bad = _nonfinite(reader, name, buffer)
            if bad is not None:
                raise CheckpointError(_nonfinite_message(reader, name, *bad))
            step()


def _nonfinite(reader: CheckpointReader, name: str, buffer: torch.Tensor) -> tuple[int, list[int]] | None:
    """``(count, index of the first)`` of the NaN/Inf values of tensor ``name``, or None when it has none."""
    count, first, seen = 0, -1, 0
    for block in reader.blocks(name, buffer):
        values = block if block.dtype.itemsize > 1 else block.float()  # float8: no min/max of its own
        if values.numel():
            lo, hi = torch.aminmax(values)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                bad = ~torch.isfinite(values)
                count += int(bad.sum())
                if first < 0:
                    first = seen + int(bad.nonzero()[0, 0])
        seen += values.numel()
    if not count:
        return None
    shape = reader.shape(name)
    return count, [int(i) for i in torch.unravel_index(torch.tensor(first), shape)] if shape else []


def validate_source(path: str | Path) -> tuple[CheckpointReader, SalaConfig]:
    """Check a bf16 source from its config and safetensors headers alone (no tensor data is read): a SALA
    config, no ``quantization_config``, every tensor the layout implies present with its shape and a float dtype,
    and no tensor it does not have. About a second for the full model; the quantizers run it before any data or
    model work (and `check_finite` after it)."""
    reader = CheckpointReader(path)  # first: a path that is not a checkpoint folder is named as such
    config = SalaConfig.from_file(path)
    qc = reader.config().get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(
            f"{reader.path}/config.json: the checkpoint is already quantized (quantization_config.quant_method "
            f"{method!r}): pass the bf16 source"
        )
    for name, shape in parameter_shapes(config).items():
        if name not in reader:
            raise CheckpointError(f"{reader.path}: tensor {name} is missing")
        if tuple(reader.shape(name)) != shape:
            raise CheckpointError(
                f"{reader.path / reader.shard_of(name)}: tensor {name} has shape {list(reader.shape(name))}, "
                f"expected {list(shape)} from config.json"
            )
        if reader.dtype(name) not in SOURCE_DTYPES:
            raise CheckpointError(
                f"{reader.path / reader.shard_of(name)}: tensor {name} has dtype {reader.dtype(name)}, expected "
                "bfloat16, float16 or float32"
            )
    _refuse_unexpected(reader, config)
    return reader, config


def _refuse_unexpected(reader: CheckpointReader, config: SalaConfig) -> None:
    """Refuse tensors the architecture does not have: no run reads them and the export would drop them without
    a word (a checkpoint of another model, or a config.json with fewer layers than the weights). The tensors
    `derived_tensor` names, which some writers store and every loader rebuilds, are accepted."""
    expected = parameter_shapes(config)
    extra = [n for n in reader if n not in expected and not derived_tensor(config, n)]
    if extra:
        shown = ", ".join(extra[:5]) + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else "")
        raise CheckpointError(
            f"{reader.path}: {len(extra)} tensor(s) that a MiniCPM-SALA model of this config.json does not have "
            f"(no run would read them, no export would keep them): {shown}; pass a checkpoint whose config.json "
            "describes all of its weights"
        )


def _fill(
    module: nn.Module,
    prefix: str,
    reader: CheckpointReader,
    shapes: dict[str, tuple[int, ...]],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> None:
    """Copy every parameter of ``module`` (named ``prefix + name``) from the checkpoint, shape-checked."""
    state: dict[str, torch.Tensor] = {}
    for name, _ in module.named_parameters(remove_duplicate=True):
        full = prefix + name
        if full not in shapes:
            raise CheckpointError(f"internal: module parameter {full} has no entry in the SALA layout")
        tensor = _read_weight(reader, full, shapes[full], device)
        state[name] = require_finite(reader, full, tensor.to(device=device, dtype=dtype or tensor.dtype))
    for name in module.state_dict():  # tied parameters appear once above, twice in the state dict
        if name not in state and name == "lm_head.weight":
            state[name] = state["model.embed_tokens.weight"]
    module.load_state_dict(state, strict=True, assign=True)


def _read_weight(
    reader: CheckpointReader, name: str, shape: tuple[int, ...], device: torch.device | str
) -> torch.Tensor:
    """A dense tensor; linears stored as GPTQ v1 (``qweight`` ...) or NVFP4 (uint8 ``weight`` + scales) are
    dequantized to bfloat16 on ``device``."""
    module = name.removesuffix(".weight")
    if name not in reader and f"{module}.qweight" in reader:
        qconfig = reader.config().get("quantization_config") or {}
        if qconfig.get("quant_method") != "gptq":
            raise CheckpointError(f"{module}.qweight found but config.json has no GPTQ quantization_config")
        from ..formats.gptq_v1.read import dequantized_weight

        return dequantized_weight(reader, module, qconfig, shape, device)
    if name in reader and reader.dtype(name) == torch.uint8 and f"{module}.weight_scale" in reader:
        from ..formats.modelopt_nvfp4.numerics import NVFP4Weight

        q = NVFP4Weight(
            weight=reader.get(name, device=device),
            weight_scale=reader.get(f"{module}.weight_scale", device=device),
            weight_scale_2=reader.get(f"{module}.weight_scale_2", device=device),
        )
        w = q.dequantize()
        if tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"{module}: NVFP4 tensors decode to shape {list(w.shape)}, expected {list(shape)}")
        return w.to(torch.bfloat16)
    return reader.get_checked(name, shape)


def _quantized_modules(reader: CheckpointReader) -> set[str]:
    return {k.removesuffix(".qweight") for k in reader if k.endswith(".qweight")}


def _check_keys(reader: CheckpointReader, expected: dict[str, tuple[int, ...]]) -> None:
    keys = set(reader.keys())
    quantized = _quantized_modules(reader)
    keys |= {f"{m}.weight" for m in quantized}
    keys -= {f"{m}.{k}" for m in quantized for k in ("qweight", "qzeros", "scales", "g_idx")}
    missing = [k for k in expected if k not in keys]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{reader.path}: tensors missing from the checkpoint: {missing[:5]}{more}")
    scale_suffixes = (".weight_scale", ".weight_scale_2", ".input_scale")
    extra = sorted(k for k in keys - set(expected) if not k.endswith(scale_suffixes))
    if extra:
        log.warning("%s: %d tensors not used by the SALA model, e.g. %s", reader.path, len(extra), extra[:3])


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype | None = None,
    reader: CheckpointReader | None = None,
) -> SalaForCausalLM:
    """Load a whole bf16 SALA checkpoint into ``SalaForCausalLM`` (weights keep their stored dtype unless
    ``dtype`` is given)."""
    reader = reader or CheckpointReader(path)
    config = SalaConfig.from_dict(reader.config())
    shapes = parameter_shapes(config)
    _check_keys(reader, shapes)
    with torch.device("meta"):
        model = SalaForCausalLM(config)
    _fill(model, "", reader, shapes, device, resolve_dtype(dtype))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class CheckpointParts:
    """One checkpoint's decoder layers and non-layer tensors, loaded one at a time onto ``device`` (in ``dtype``,
    the stored dtype when ``None``): the calibration engine's and the budget measurement's unit of work.

    Every load closes the reader's shard handles after it: the shards are memory-mapped, and the pages read stay in
    the process's resident set while a handle is open, so a run over every layer would otherwise accumulate the
    whole checkpoint there."""

    reader: CheckpointReader
    config: SalaConfig
    device: torch.device | str = "cpu"
    dtype: str | torch.dtype | None = None

    def layer(self, index: int) -> DecoderLayer:
        """Decoder layer ``index``, shape-checked."""
        with torch.device("meta"):
            layer = DecoderLayer(self.config, index)
        shapes = layer_parameter_shapes(self.config, index)
        _fill(layer, f"model.layers.{index}.", self.reader, shapes, self.device, resolve_dtype(self.dtype))
        self.reader.close()
        return layer.eval().requires_grad_(False)

    def tensor(self, name: str) -> torch.Tensor:
        """One of the non-layer tensors (embeddings, final norm, lm_head), shape-checked."""
        shapes = global_parameter_shapes(self.config)
        if name not in shapes:
            raise CheckpointError(f"{name} is not a global tensor of a SALA checkpoint ({sorted(shapes)})")
        tensor = self.reader.get_checked(name, shapes[name])
        tensor = tensor.to(device=self.device, dtype=resolve_dtype(self.dtype) or tensor.dtype)
        tensor = require_finite(self.reader, name, tensor)
        self.reader.close()
        return tensor
