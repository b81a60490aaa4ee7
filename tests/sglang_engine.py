"""SGLang's own code for MiniCPM-SALA, run on a CPU: config parsing, quantization choice, model construction and
weight loading, exactly as ``python -m sglang.launch_server`` runs them before the first forward.

What runs is SGLang's: ``ServerArgs`` published as the process config, ``ModelConfig`` (which parses
``config.json`` into ``MiniCPMHybridConfig`` and decides the quantization method from the checkpoint and the
``--quantization`` value), the model loader's ``_get_quantization_config`` and ``_initialize_model`` (which builds
``MiniCPMSALAForCausalLM``, every linear asking the quantization config for its method by prefix and creating
its parameters), ``safetensors_weights_iterator`` over the export's files and the model's ``load_weights``.
What does not run is everything after loading that needs a GPU: ``process_weights_after_loading`` (Marlin
repacking, FP4 swizzling) and the forward.

Stand-ins, each for something that cannot run on a CPU and cannot change what is checked:

- ``sglang.srt.multimodal.internvl_utils`` and ``sglang.srt.configs.deepseek_ocr``: image preprocessing and the
  config of other models (InternVL, DeepSeek-OCR), imported by ``sglang.srt.configs`` for its registry; they
  import torchvision, whose registry build does not load beside the CPU build of torch. Their names resolve to
  empty classes with a model type of their own, so they take no registry entry SALA could hit.
- ``vllm._custom_ops``: SGLang's rotary embedding imports a rotary kernel from it when it is built off CUDA;
  rotary embeddings hold no weights and no forward runs here.
- The GPU's compute capability: SGLang asks the device for it to decide whether Marlin kernels exist
  (``gptq_marlin`` or plain ``gptq``, the FP4 backend) and to refuse formats a GPU is too old for; with no GPU
  it would report none. It reports 9.0 here, an H200, the GPU these exports are measured on.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STAND_INS = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr", "vllm", "vllm._custom_ops")
CAPABILITY = (9, 0)


def available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def version() -> str:
    return importlib.metadata.version("sglang")


class _Empty:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StandInModule(types.ModuleType):
    """Every public name is an empty class of its own."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Empty,), {"model_type": f"stand-in:{self.__name__}.{name}"})
        setattr(self, name, cls)
        return cls


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in STAND_INS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "vllm")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_READY = False


def _prepare() -> None:
    """Install the stand-ins once, before SGLang is imported."""
    global _READY
    if _READY:
        return
    # SGLang's import takes over transformers' AutoConfig entry for "minicpm_sala" (and any other entry it
    # knows); its get_config re-parses the file through its own registry either way, so the entries registered
    # before it (salaquant's among them) are put back for the rest of the process.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import salaquant.model.hf  # noqa: F401

    registered = dict(CONFIG_MAPPING._extra_content)
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns())
    warnings.filterwarnings("ignore", module="sglang")
    logging.getLogger("sglang").setLevel(logging.ERROR)
    import sglang.srt.layers.quantization.marlin_utils as marlin_utils
    import sglang.srt.model_loader.loader as loader
    import sglang.srt.utils.hf_transformers_utils  # noqa: F401  (registers SGLang's configs)

    CONFIG_MAPPING._extra_content.update(registered)
    marlin_utils.get_device_capability = lambda *args, **kwargs: CAPABILITY
    loader.get_device_capability = lambda *args, **kwargs: CAPABILITY
    _READY = True


@dataclass
class Loaded:
    """What SGLang built and loaded from one export."""

    model: torch.nn.Module
    quantization: str | None  # the method ModelConfig settled on
    hf_config: Any  # SGLang's parsed config (MiniCPMHybridConfig)
    parameters: dict[str, torch.Tensor]  # those the checkpoint must write
    optional: set[str]  # those SGLang flags ``_skip_weight_check`` (KV-cache scales, defaulted when absent)


def parse_config(path: Path) -> Any:
    """SGLang's ``MiniCPMHybridConfig`` of ``path/config.json`` (through its ``get_config``)."""
    _prepare()
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(str(path), trust_remote_code=False)


def _weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    yield from safetensors_weights_iterator(sorted(str(p) for p in path.glob("*.safetensors")))


def load(path: Path, quantization: str | None = None, fill: int = 0) -> Loaded:
    """Build SGLang's model for the export at ``path`` served with ``--quantization quantization`` and load its
    weights. Every parameter is first filled with the byte ``fill``, so that two loads with different fills tell
    which bytes no checkpoint tensor wrote."""
    _prepare()
    from sglang.srt import runtime_context
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(ServerArgs(model_path=str(path), quantization=quantization, device="cpu"), role="test")
    model_config = ModelConfig(str(path), trust_remote_code=False, quantization=quantization)
    load_config = LoadConfig()
    quant_config = loader._get_quantization_config(model_config, load_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what the model runner sets for a bf16 checkpoint
    try:
        with runtime_context.get_parallel().override(tp_size=1, tp_rank=0):
            model = loader._initialize_model(model_config, load_config, quant_config)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.data.reshape(-1).view(torch.uint8).fill_(fill)
        model.load_weights(_weights(path))
    optional = {name for name, p in params.items() if getattr(p, "_skip_weight_check", False)}
    required = {name: p for name, p in params.items() if name not in optional}
    return Loaded(model, model_config.quantization, model_config.hf_config, required, optional)


def unwritten(path: Path, quantization: str | None = None) -> dict[str, int]:
    """Parameter name -> number of bytes that no checkpoint tensor wrote (loads twice, with 0x00 and 0xFF fills),
    for every parameter SGLang needs from the checkpoint."""
    a = load(path, quantization, fill=0x00).parameters
    b = load(path, quantization, fill=0xFF).parameters
    out = {}
    for name, p in a.items():
        differ = int((p.data.reshape(-1).view(torch.uint8) != b[name].data.reshape(-1).view(torch.uint8)).sum())
        if differ:
            out[name] = differ
    return out


def linear_methods(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> the class of the quant method SGLang chose for every linear layer."""
    from sglang.srt.layers.linear import LinearBase

    return {
        name: type(module.quant_method).__name__
        for name, module in model.named_modules()
        if isinstance(module, LinearBase)
    }
