"""``load(path)``: a SALA model whose quantized linears run from their packed tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..io.files import CheckpointError
from ..io.reader import CheckpointReader
from ..kernels.backend import check_backend
from ..model.config import ConfigError, SalaConfig
from ..model.layers import RMSNorm
from ..model.layout import parameter_shapes
from ..model.loading import _check_keys, require_finite, resolve_dtype
from ..model.modeling import SalaForCausalLM
from .fuse import fuse_projections
from .linear import GPTQLinear, NVFP4Linear

ACTIVATIONS = ("bf16", "fp4")
"""What the runtime feeds the quantized linears: 16-bit activations, or FP4 ones for NVFP4 (W4A4)."""


def resolve_activations(requested: str, fmt: str) -> str:
    """The activations an export of format ``fmt`` runs with: ``"auto"`` is FP4 for NVFP4 (W4A4, as Blackwell runs
    it) and 16-bit otherwise; ValueError for FP4 on a weight-only format."""
    if requested not in ("auto", *ACTIVATIONS):
        raise ValueError(f"activations must be one of auto, {', '.join(ACTIVATIONS)}; got {requested!r}")
    got = requested if requested != "auto" else ("fp4" if fmt == "nvfp4" else "bf16")
    if got == "fp4" and fmt != "nvfp4":
        raise ValueError(f"activations='fp4' needs an NVFP4 export; this one is {fmt} (weight-only)")
    return got


def checkpoint_format(reader: CheckpointReader) -> str:
    """ "bf16", "gptq" or "nvfp4", from config.json's quantization_config."""
    qc = reader.config().get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None:
        return "bf16"
    if method == "gptq":
        return "gptq"
    if method == "modelopt" and "FP4" in str(qc.get("quant_algo", "")):
        return "nvfp4"
    raise ValueError(f"{reader.path}: quantization_config.quant_method {method!r} is not supported by the runtime")


def open_checked(
    path: str | Path, device: torch.device, backend: str = "auto"
) -> tuple[CheckpointReader, SalaConfig, str]:
    """What `load` checks before it reads a tensor, for a command to run before any other work: ``backend`` on
    ``device`` (`check_backend`), a SALA config, a format the runtime serves, and every tensor against the shape
    ``config.json`` implies (the checks ``salaquant check`` and ``eval`` run: a served model is built from the
    config, so an export whose config disagrees with its tensors must not load). Returns the reader, the config and
    the format; `CheckpointError` / `ConfigError` / `ValueError` name the folder, file or flag."""
    from ..formats.check import config_problems

    check_backend(backend, device)
    reader = CheckpointReader(path)
    raw = reader.config()
    try:
        config = SalaConfig.from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{reader.path / 'config.json'}: {exc}") from exc
    fmt = checkpoint_format(reader)
    problems = config_problems(reader, raw)
    if problems:
        more = f"; ... ({len(problems)} in all)" if len(problems) > 3 else ""
        raise CheckpointError(f"{reader.path}: the tensors disagree with config.json: {'; '.join(problems[:3])}{more}")
    return reader, config, fmt


def use_layer_kernels(layer: nn.Module, backend: str = "auto") -> None:
    """Route one decoder layer's norms, GLA, sparse attention and static-cache decode attention through
    ``salaquant.kernels`` by ``backend`` (``"auto"``: Triton on CUDA tensors, the PyTorch references elsewhere): the
    model's dispatchers with it bound."""
    from ..model.gla import simple_gla
    from ..model.sparse_attention import infllm_v2_attention

    for m in layer.modules():
        if isinstance(m, RMSNorm):
            m.backend = backend
    attn = layer.self_attn
    if hasattr(attn, "gla_fn"):
        attn.gla_fn = lambda *a, **k: simple_gla(*a, backend=backend, **k)
    if hasattr(attn, "sparse_fn"):
        attn.sparse_fn = lambda *a, **k: infllm_v2_attention(*a, backend=backend, **k)
        attn.decode_backend = backend


def use_kernels(model: SalaForCausalLM, backend: str = "auto") -> None:
    """``use_layer_kernels`` on every decoder layer of ``model``."""
    for layer in model.model.layers:
        use_layer_kernels(layer, backend)


def load(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "bf16",
    backend: str = "auto",
    kernels: bool = True,
    activations: str = "bf16",
    fuse: bool = True,
) -> SalaForCausalLM:
    """Load a bf16, GPTQ or NVFP4 checkpoint (detected from its config) into ``SalaForCausalLM``.

    Quantized linears become ``GPTQLinear`` / ``NVFP4Linear`` modules holding the packed tensors; every other
    tensor is loaded as stored (cast to ``dtype``). With ``kernels`` the GLA and sparse-attention calls go
    through ``salaquant.kernels`` too (Triton on CUDA tensors, the PyTorch references elsewhere; both pass
    the same tests); ``kernels=False`` keeps the model's own PyTorch attention code. ``activations="fp4"`` runs an
    NVFP4 export W4A4, as Blackwell serves it: each NVFP4 linear quantizes its inputs with the export's
    ``input_scale`` (``"bf16"``, the default, keeps them 16-bit: the weight-only path of older GPUs). With ``fuse``
    q/k/v and gate/up run as one linear each (``runtime.fuse``), as the serving engines run them.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    reader, config, fmt = open_checked(path, torch.device(device), backend)
    if activations == "fp4":
        try:
            resolve_activations(activations, fmt)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    dt = resolve_dtype(dtype)
    shapes = parameter_shapes(config)
    _check_keys(reader, shapes)
    with torch.device("meta"):
        model = SalaForCausalLM(config)
    qc = reader.config().get("quantization_config") or {}
    state: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:  # every float tensor is checked: a NaN scale must not load silently
        return require_finite(reader, name, reader.get(name, device))

    for name in shapes:
        module_name = name.removesuffix(".weight")
        if fmt == "gptq" and f"{module_name}.qweight" in reader:
            from ..formats.gptq_v1.dynamic import plan_for

            plan = plan_for(qc.get("dynamic") or {}, module_name, int(qc["bits"]), int(qc["group_size"]))
            assert plan.bits is not None
            _swap(
                model,
                module_name,
                GPTQLinear(
                    get(f"{module_name}.qweight"),
                    get(f"{module_name}.scales"),
                    plan.bits,
                    plan.group_size,
                    backend,
                ),
            )
        elif fmt == "nvfp4" and name in reader and reader.dtype(name) == torch.uint8:
            _swap(
                model,
                module_name,
                NVFP4Linear(
                    get(name),
                    get(f"{module_name}.weight_scale"),
                    get(f"{module_name}.weight_scale_2"),
                    backend,
                    get(f"{module_name}.input_scale") if activations == "fp4" else None,
                ),
            )
        else:
            state[name] = require_finite(
                reader, name, reader.get_checked(name, shapes[name]).to(device=device, dtype=dt)
            )
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"{path}: parameters left unloaded: {missing[:5]}")
    if fuse:
        fuse_projections(model)
    if kernels:
        use_kernels(model, backend)
    return model.eval().requires_grad_(False)


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)
