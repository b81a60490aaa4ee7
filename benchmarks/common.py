"""What the benchmarks share: the repository's paths (shipped models, calibration sample), where a benchmark's JSON
goes, the shape benchmarks' arguments and the calibration pass's FLOP count.

Every script in ``benchmarks/`` runs as ``python benchmarks/NAME.py`` (this folder on ``sys.path``); the studies in
``benchmarks/studies/`` reach this module through ``studies/scoring.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console

from salaquant.model.config import LIGHTNING, SalaConfig
from salaquant.model.layout import input_groups, layer_linears

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sala-tiny"
SMALL = ROOT / "models" / "sala-small"
CALIB = ROOT / "calib" / "sala-tiny-calib.jsonl"
"""The shipped calibration sample (sala-tiny's tokenizer; sala-small shares it)."""

KERNEL_SHAPES: dict[str, tuple[int, int]] = {
    "gate_up": (4096, 32768),
    "down": (16384, 4096),
    "lightning_qkv": (4096, 12288),
    "o_proj": (4096, 4096),
}
"""The weight-only GEMM benchmarks' linears at MiniCPM-SALA's shape: layer name -> (K, N)."""
KERNEL_MS = (1, 16, 128, 4096)
"""The GEMM benchmarks' row counts M: one decode row, a small batch, a prefill chunk and a long prefill."""
WEIGHT_COPIES = 4
"""Weight copies a GEMM benchmark cycles through, so that each call reads its weights from HBM rather than L2."""


def quiet() -> Console:
    """A console that prints nothing (the quantizers' progress inside a benchmark)."""
    return Console(quiet=True)


def write_results(out: Path, default_name: str, payload: object, indent: int | None = 2) -> Path:
    """Write ``payload`` as JSON to ``out`` (a ``.json`` path) or to ``out / default_name``; returns the path."""
    path = out if out.suffix == ".json" else out / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent))
    print(f"wrote {path}")
    return path


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark at a model preset's shape: ``--out``, ``--preset`` (default ``full``, the
    published shape) and ``--device``; the description is the first paragraph of ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    return ap


def quality_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a sala-tiny quality measurement: ``--out``, the calibration set (``--max-samples`` samples
    of at most ``--max-len`` tokens) and the held-out windows (``--windows`` of ``--window-len`` tokens), with
    ``benchmarks/quality.py``'s defaults, so that studies score on its data; the description is ``doc``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window-len", type=int, default=1024)
    return ap


def work_flops(cfg: SalaConfig, lengths: list[int], hessian: bool) -> dict[str, float]:
    """FLOPs of the forward pass plus the X^T X products for the given sample lengths (one pass)."""
    linear = attn = hess = 0.0
    for kind in cfg.mixer_types:
        specs = {s.name: s for s in layer_linears(cfg, kind)}
        per_token = sum(2 * s.out_features * s.in_features for s in specs.values())
        dims = [specs[g.members[0]].in_features for g in input_groups(cfg, kind)]
        for t in lengths:
            linear += per_token * t
            if hessian:
                hess += sum(2 * t * d * d for d in dims)
            if kind == LIGHTNING:  # chunked GLA: ~4 matmuls of [64 x D] per token and head
                attn += t * cfg.lightning_nh * 4 * 2 * 64 * cfg.lightning_head_dim
            else:  # causal softmax attention: QK^T and PV over half the square
                attn += 2 * 2 * t * t / 2 * cfg.num_attention_heads * cfg.head_dim
    return {"linear": linear, "attention": attn, "hessian": hess, "total": linear + attn + hess}


def fp4_activations(model: torch.nn.Module, scales: dict[str, float]) -> torch.nn.Module:
    """Quantize the input of each named linear to NVFP4 with its activation scale (``input_scale``, ModelOpt's
    convention) before it runs, as Blackwell's FP4 GEMM does (``quantize_activations``, ModelOpt's numerics): W4A4
    scoring of an export written with dequantized weights."""
    from salaquant.formats.modelopt_nvfp4.numerics import quantize_activations

    for name, scale in scales.items():
        value = torch.tensor(scale, dtype=torch.float32)
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, s=value: (quantize_activations(args[0], s.to(args[0].device)), *args[1:])
        )
    return model
