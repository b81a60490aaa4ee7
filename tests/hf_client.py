"""Load GPTQ exports with one HF-ecosystem client and print what it built, as JSON (run by test_hf_clients.py).

    python tests/hf_client.py transformers|gptqmodel EXPORT [EXPORT ...]

Runs in a fresh interpreter because importing GPTQModel patches transformers for the rest of the process. The
import order is the user's: ``import salaquant`` first, then the client, nothing registered by hand. For each
export: the loading report (missing / unexpected / mismatched keys, or the exception), the modules that became
quantized linears (with their bits), and the client's logits against salaquant's runtime in fp32 (the reference:
``salaquant.runtime.load``, unfused, PyTorch code), on 64 fixed random tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import salaquant  # noqa: F401  (registers SALA with transformers and GPTQModel, in any import order)
from salaquant.formats.gptq_v1.dynamic import plan_for
from salaquant.formats.gptq_v1.packing import dequantize_gptq_v1
from salaquant.io.reader import CheckpointReader
from salaquant.runtime.load import load

TOKENS = 64


def _reference(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = load(path, dtype="fp32", kernels=False, fuse=False)
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, model(ids).logits.float()


def _compare(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(logits.float(), -1)
    return {
        "max_abs": float((logits.float() - ref).abs().max()),
        "kl": float((p.exp() * (p - q)).sum(-1).mean()),
        "top1": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def _quantized(model: torch.nn.Module) -> dict[str, int]:
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return {name: int(m.bits) for name, m in model.named_modules() if isinstance(m, BaseQuantLinear)}


def with_transformers(path: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GPTQConfig

    ids, ref = _reference(path)
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                # GPTQModel's plain-PyTorch kernel: its AVX-512 one compiles C++ for minutes on first use
                quantization_config=GPTQConfig(bits=4, backend="torch"),
                output_loading_info=True,
            )
        except Exception as exc:  # the refusal itself is what the test checks
            return {"error": f"{type(exc).__name__}: {exc}"}
        with torch.no_grad():
            logits = model(ids).logits
        out[name] = _compare(logits, ref)
        out["class"] = type(model).__name__
        out["keys"] = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}
        out["quantized"] = _quantized(model)
    return out


def with_gptqmodel(path: str) -> dict[str, Any]:
    from gptqmodel import GPTQModel

    ids, ref = _reference(path)
    # GPTQModel's torch kernel runs fp16 / bf16 only; in fp16 the stored fp16 scales stay exact, so its
    # dequantized weights can be compared bit for bit
    qmodel = GPTQModel.load(path, backend="torch", device="cpu", dtype=torch.float16)
    model = qmodel.model
    with torch.no_grad():
        logits = model(ids).logits
    reader = CheckpointReader(Path(path))
    qc = reader.config()["quantization_config"]
    unequal = []
    quantized = _quantized(model)
    for name, module in model.named_modules():
        if name in quantized:
            plan = plan_for(qc.get("dynamic") or {}, name, int(qc["bits"]), int(qc["group_size"]))
            tensors = {k: reader.get(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
            ours = dequantize_gptq_v1(tensors, plan.bits).half()  # fp32 scale x integer, rounded once to fp16
            theirs = module.dequantize_weight().t()
            if not torch.equal(ours, theirs):
                unequal.append(name)
    return {
        "class": type(model).__name__,
        "definition": type(qmodel).__name__,
        "quantized": quantized,
        "dequantize_unequal": unequal,
        "fp16": _compare(logits, ref),
    }


def main() -> None:
    client, paths = sys.argv[1], sys.argv[2:]
    run = {"transformers": with_transformers, "gptqmodel": with_gptqmodel}[client]
    print("RESULT " + json.dumps({path: run(path) for path in paths}))


if __name__ == "__main__":
    main()
