"""What the peer runners share: loading a SALA checkpoint into ``transformers``, salaquant's calibration token
sequences, the checks on a fake-quantized weight, writing the bf16 checkpoint quality.py scores, the check of that
checkpoint against the peer's in-memory model, and the failure record.

Each runner runs as ``python benchmarks/peers/NAME.py`` inside its peer's virtual environment, so this folder is on
``sys.path`` and the runners import this module as ``peer_common``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import shutil
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


class Step:
    """The step in progress, named in the failure record."""

    def __init__(self) -> None:
        self.name = "start"

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.name = name
        yield


def version(package: str) -> str:
    """The installed version of ``package``, or "not installed"."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def load_hf_model(path: Path, attention_mode: str) -> Any:
    """The SALA checkpoint at ``path`` as ``transformers`` loads it (bf16, eval mode), its minicpm4 layers running
    ``attention_mode``."""
    from transformers import AutoModelForCausalLM

    import salaquant.model.hf  # noqa: F401  (registers model_type minicpm_sala)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    model.attention_mode = attention_mode
    return model


def calibration_samples(
    model_path: Path, calib: str, max_samples: int, max_len: int, bos: bool = True
) -> tuple[Any, list[torch.Tensor], dict[str, Any]]:
    """The tokenizer, the token sequences ``salaquant.calibration.calib_data.load_calibration`` gives (one int64
    tensor per sample; each begins with BOS unless ``bos`` is false) and their summary (samples, tokens, lengths,
    fingerprint)."""
    from transformers import AutoTokenizer

    from salaquant.calibration.calib_data import CalibOptions, load_calibration

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = load_calibration([calib], tokenizer, CalibOptions(max_samples=max_samples, max_len=max_len, bos=bos))
    samples = [s.ids.to(torch.int64) for s in data]
    summary = data.summary()
    info = {
        "samples": summary["samples"],
        "tokens": summary["tokens"],
        "min_len": summary["min_len"],
        "max_len": summary["max_len"],
        "fingerprint": data.fingerprint(),
    }
    return tokenizer, samples, info


def levels_per_group(w: torch.Tensor, group_size: int) -> int:
    """The largest number of distinct values in one row over one group of ``group_size`` inputs."""
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group_size, group_size)
    ordered = groups.sort(dim=-1).values
    return int(((ordered[..., 1:] != ordered[..., :-1]).sum(-1) + 1).max())


def read_source(source_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the source checkpoint, by name, as salaquant reads it (one ``model.safetensors`` or the
    shards its index lists)."""
    from salaquant.io.reader import CheckpointReader

    with CheckpointReader(source_dir) as reader:
        return {name: reader.get(name) for name in reader.keys()}  # noqa: SIM118


def write_checkpoint(
    source_dir: Path, out: Path, tensors: dict[str, torch.Tensor], input_scales: dict[str, float]
) -> None:
    """Write OUT as a plain bf16 checkpoint salaquant reads: the source's ``config.json`` (without a
    ``quantization_config``) and tokenizer files, ``model.safetensors`` with ``tensors`` and, when activations are
    quantized, ``input_scales.json`` (each quantized linear's activation scale, ModelOpt's ``input_scale``)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname in TOKENIZER_FILES:
        if (source_dir / fname).is_file():
            shutil.copy2(source_dir / fname, out / fname)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if input_scales:  # W4A4: what the activations are quantized with, for the scorer's FP4 activation emulation
        (out / "input_scales.json").write_text(json.dumps(input_scales, indent=2) + "\n")
    (out / "model.safetensors").chmod(0o644)


def module_or_none(model: Any, name: str) -> torch.nn.Module | None:
    """The submodule called ``name``, or None."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@torch.no_grad()
def forward_check(model: Any, source: Path, out: Path, ids: torch.Tensor, attention_mode: str) -> dict[str, float]:
    """The written checkpoint against the peer's in-memory quantized model on one calibration prefix: the largest
    |logit| difference (weight-only schemes: the same computation, so near zero) and, for W4A4, the mean
    KL(source || each) with the written model's linears quantizing their inputs by ``input_scales.json`` and
    salaquant's NVFP4 activation quantizer (what the scorer runs; it rounds in fp32 as the FP4 GEMM's quantizer
    does, where a peer's fake quantization may round in the activations' bf16, so single tokens differ and the
    comparable figure is the KL)."""
    from salaquant.formats.modelopt_nvfp4.numerics import quantize_activations

    written = load_hf_model(out, attention_mode)
    scales_file = out / "input_scales.json"
    scales = json.loads(scales_file.read_text()) if scales_file.exists() else {}
    for name, scale in scales.items():
        s = torch.tensor(scale, dtype=torch.float32)
        written.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, s=s: (quantize_activations(args[0], s).to(args[0].dtype), *args[1:])
        )
    a = model(ids[None], attention_mode=attention_mode).logits.float()
    b = written(ids[None], attention_mode=attention_mode).logits.float()
    result = {"max_abs_logit_diff": float((a - b).abs().max())}
    if scales:
        ref = load_hf_model(source, attention_mode)(ids[None], attention_mode=attention_mode).logits.float()
        lp = ref.log_softmax(-1)
        for key, logits in (("kl_in_memory", a), ("kl_written_emulated", b)):
            result[key] = float((lp.exp() * (lp - logits.log_softmax(-1))).sum(-1).mean())
    return result


def failure_record(
    exc: BaseException, step: str, tool: str, package: str, frames_of: tuple[str, ...]
) -> dict[str, Any]:
    """What a failed run writes to peer.json: the error, the step and the innermost frame of one of the
    ``frames_of`` packages (else the innermost frame), with the traceback's tail."""
    frames = traceback.extract_tb(exc.__traceback__)
    peer = [f for f in frames if any(f"/{p}/" in f.filename for p in frames_of)]
    frame = peer[-1] if peer else (frames[-1] if frames else None)
    where = step
    if frame is not None:
        where += f": {frame.name} ({short_path(frame.filename)}:{frame.lineno})"
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "tool": tool,
        "version": version(package),
        "error": f"{type(exc).__name__}: {exc}",
        "where": where,
        "traceback_tail": tail[-6000:],
    }


def short_path(filename: str) -> str:
    """``filename`` from its package folder on (site-packages or salaquant), else as it is."""
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    if "/salaquant/" in filename:
        return "salaquant/" + filename.split("/salaquant/", 1)[1]
    return filename


def peer_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every runner takes: the source, the calibration samples (as salaquant reads them), the output,
    the minicpm4 layers' attention while calibrating, torch threads and the linears kept in bf16."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="source SALA checkpoint folder (bf16)")
    ap.add_argument("--calib", type=str, required=True, help="calibration source (as salaquant --calib)")
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--no-bos", action="store_true", help="calibration samples without BOS (salaquant --no-bos)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--attention-mode",
        choices=("dense", "auto", "sparse"),
        default="dense",
        help="attention of the minicpm4 layers during calibration (salaquant calibrates with dense)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument(
        "--ignore",
        nargs="*",
        default=[],
        help="module-name regexes kept in bf16 (besides lm_head), e.g. to match the linears another tool keeps",
    )
    return ap


def kept_linears(model: Any, source: dict[str, torch.Tensor], quantized: dict[str, Any]) -> list[str]:
    """The source's linears the peer left unquantized; refuses a quantized module without a source weight."""
    missing = sorted(set(quantized) - {n.removesuffix(".weight") for n in source})
    if missing:
        raise RuntimeError(f"quantized modules with no weight in the source checkpoint: {missing}")
    return sorted(
        n.removesuffix(".weight")
        for n in source
        if n.endswith(".weight")
        and isinstance(module_or_none(model, n.removesuffix(".weight")), torch.nn.Linear)
        and n.removesuffix(".weight") not in quantized
    )


def weight_errors(per_module: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Mean and largest relative weight error over the quantized modules."""
    errors = [m["rel_error"] for m in per_module.values()]
    return {"weight_rel_error_mean": sum(errors) / len(errors), "weight_rel_error_max": max(errors)}
