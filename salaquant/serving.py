"""What SGLang serves of MiniCPM-SALA: the engine facts every export and check is held to.

SGLang builds MiniCPM-SALA (``MiniCPMSALAForCausalLM``, config ``MiniCPMHybridConfig``) from ``config.json`` and
fills it from the safetensors files. The facts below are the ones an export depends on; the tests run SGLang's own
config parsing, quantization choice, model construction and weight loading against them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import torch

SGLANG_VERSION = "0.5.23"

PLAIN_DTYPE = torch.bfloat16
"""The dtype of every tensor an export keeps unquantized (embeddings, norms, lm_head, linears left in 16 bits)
and its ``config.json`` ``torch_dtype``, whatever the source's: SGLang runs MiniCPM-SALA in it and the GPTQ
Marlin and FP4 kernels take bf16 activations (a float32 lm_head fails the format check)."""


@dataclass(frozen=True)
class ServedFormat:
    """How SGLang serves one export format."""

    quant_method: str  # ``quantization_config.quant_method`` of the export
    flag: str  # the ``--quantization`` value SGLang takes for it
    min_capability: tuple[int, int]  # oldest GPU compute capability with a kernel for it
    kernels: str  # which kernels run it, by GPU generation


FORMATS: dict[str, ServedFormat] = {
    "gptq": ServedFormat(
        quant_method="gptq",
        flag="gptq_marlin",
        min_capability=(8, 0),
        kernels="GPTQ Marlin W4A16 from compute capability 8.0 (Ampere, Ada, Hopper, Blackwell)",
    ),
    "modelopt": ServedFormat(
        quant_method="modelopt",
        flag="modelopt_fp4",
        min_capability=(8, 0),
        kernels=(
            "weight-only through FP4 Marlin on compute capability 8.0-9.x (Ampere, Ada, Hopper); "
            "W4A4, activations in FP4, from 10.0 (Blackwell)"
        ),
    ),
}

# SGLang builds MiniCPM-SALA's lm_head (``ParallelLMHead``) without a quantization config, so it expects
# ``lm_head.weight`` in bf16 and fails on any quantized lm_head tensor.
LM_HEAD_REFUSAL = (
    f"SGLang {SGLANG_VERSION} builds MiniCPM-SALA's lm_head without a quantization config and fails to load a "
    "quantized one (KeyError: 'lm_head.g_idx'); no engine serves SALA with a quantized lm_head, so it stays bf16"
)


def format_of(quant_method: str) -> ServedFormat:
    """The served format of ``quant_method`` (KeyError names the methods known)."""
    try:
        return FORMATS[quant_method]
    except KeyError:
        raise KeyError(f"no served format for quant_method {quant_method!r} (known: {sorted(FORMATS)})") from None


def serve_command(path: str, quant_method: str, tp: int = 1) -> str:
    """The SGLang launch command for an export of ``quant_method`` at ``path``, quoted for a POSIX shell."""
    tp_flag = f" --tp {tp}" if tp > 1 else ""
    flag = format_of(quant_method).flag
    return f"python -m sglang.launch_server --model-path {shlex.quote(path)} --quantization {flag}{tp_flag}"


def serving_lines(path: str, quant_method: str, tp: int = 1) -> list[str]:
    """What a user needs to serve the export: the command and the GPUs it runs on."""
    fmt = format_of(quant_method)
    major, minor = fmt.min_capability
    return [
        f"serve: {serve_command(path, quant_method, tp)}",
        f"GPUs: compute capability {major}.{minor} or newer; {fmt.kernels}",
    ]
