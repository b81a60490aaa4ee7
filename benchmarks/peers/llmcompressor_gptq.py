"""Peer runner: llm-compressor's GPTQ (W4A16, NVFP4A16 or NVFP4 W4A4; optionally after SmoothQuant) on a SALA
checkpoint, on CPU.

Runs inside the virtual environment made by ``benchmarks/peers/setup_llmcompressor.sh``::

    python benchmarks/peers/llmcompressor_gptq.py --model models/sala-tiny \\
        --calib calib/sala-tiny-calib.jsonl --max-samples 32 --max-len 2048 --out OUT [--smoothquant]
        [--scheme W4A16|NVFP4A16|NVFP4] [--weight-observer NAME]

The model is loaded with ``AutoModelForCausalLM`` (after ``import salaquant.model.hf``), the calibration
samples are the token sequences ``salaquant.calibration.calib_data.load_calibration`` gives (so both tools see the
same tokens), and ``oneshot`` runs ``GPTQModifier(targets="Linear", scheme=SCHEME, ignore=["lm_head"])`` (NVFP4
schemes with ``actorder="static"``, as llm-compressor's NVFP4 GPTQ example; ``--weight-observer`` names the observer
that sets the weight scales in place of the scheme's, e.g. ``fouroversix``, llm-compressor's four-over-six observer),
preceded with ``--smoothquant`` by a ``SmoothQuantModifier`` (default strength) with explicit SALA
mappings. OUT then holds a plain bf16 checkpoint that salaquant reads: ``config.json`` and the tokenizer
files copied from the source, and ``model.safetensors`` with every tensor of the source under the same
name, each quantized linear's weight replaced by the weight llm-compressor's quantized module computes
with (its fake-quantized weight); for W4A4 ``input_scales.json`` holds each quantized linear's activation scale
(``1 / input_global_scale``). ``OUT/peer.json`` records the run, or on failure the exception, the
step and the llm-compressor / compressed-tensors frame where it happened (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peer_common import (
    Step,
    calibration_samples,
    forward_check,
    kept_linears,
    levels_per_group,
    load_hf_model,
    peer_arguments,
    read_source,
    version,
    weight_errors,
    write_checkpoint,
)
from peer_common import failure_record as _failure_record

SCHEMES: dict[str, tuple[int, int, str]] = {
    "W4A16": (128, 16, "int4 symmetric, group 128"),
    "NVFP4A16": (16, 15, "NVFP4 weights (E2M1, FP8 scales per 16, global scale), 16-bit activations"),
    "NVFP4": (16, 15, "NVFP4 weights and activations (W4A4; activation block scales dynamic, global scale calibrated)"),
}
"""Scheme -> (inputs per group, most distinct values in one, description): E2M1 has 15 values (+-0 are one)."""
IGNORE = ["lm_head"]
# Module frames of these packages are the ones "where" points at on failure.
PEER_PACKAGES = ("llmcompressor", "compressed_tensors", "transformers", "salaquant")

# SmoothQuant mappings for SALA: each entry is (balance layers, smooth layer). The output of
# input_layernorm feeds q/k/v and the output gate (o_gate in minicpm4 layers, z_proj in lightning
# layers); llm-compressor's default mappings list only q/k/v, which would leave the gate reading the
# smoothed activations with unscaled weights, so the gate is listed here too. post_attention_layernorm
# feeds gate_proj and up_proj.
SALA_SMOOTHQUANT_MAPPINGS: list[list[Any]] = [
    [
        [
            "re:.*self_attn\\.q_proj$",
            "re:.*self_attn\\.k_proj$",
            "re:.*self_attn\\.v_proj$",
            "re:.*self_attn\\.(o_gate|z_proj)$",
        ],
        "re:.*input_layernorm$",
    ],
    [["re:.*mlp\\.gate_proj$", "re:.*mlp\\.up_proj$"], "re:.*post_attention_layernorm$"],
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = peer_arguments(__doc__)
    ap.add_argument("--smoothquant", action="store_true", help="run SmoothQuantModifier before GPTQ")
    ap.add_argument("--scheme", choices=tuple(SCHEMES), default="W4A16", help="llm-compressor's preset scheme")
    ap.add_argument(
        "--weight-observer",
        help="llm-compressor's observer for the weight scales (GPTQModifier weight_observer), e.g. fouroversix; "
        "default: the scheme's",
    )
    ap.add_argument(
        "--pipeline",
        choices=("sequential", "basic"),
        default="sequential",
        help="llm-compressor calibration pipeline: 'sequential' (one oneshot; every modifier gets its own "
        "layer-by-layer pass) or 'basic' (whole-model passes; one oneshot per modifier)",
    )
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------- steps


def calibration_dataset(
    model_path: Path, calib: str, max_samples: int, max_len: int, bos: bool
) -> tuple[Any, Any, dict]:
    """The tokenizer, a ``datasets.Dataset`` with one ``input_ids`` row per salaquant calibration sample,
    and the salaquant summary (samples, tokens, fingerprint)."""
    from datasets import Dataset

    tokenizer, samples, info = calibration_samples(model_path, calib, max_samples, max_len, bos)
    rows = [s.tolist() for s in samples]
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    return tokenizer, dataset, info


def gptq_modifier(ignore: list[str], scheme: str, weight_observer: str | None = None) -> Any:
    """GPTQ with the scheme's defaults; NVFP4 schemes with static activation order, as llm-compressor's NVFP4 GPTQ
    example runs it (block scales fixed before the sweep); ``weight_observer`` replaces the scheme's weight
    observer."""
    from llmcompressor.modifiers.quantization import GPTQModifier

    extra: dict[str, Any] = {"actorder": "static"} if scheme.startswith("NVFP4") else {}
    if weight_observer is not None:
        extra["weight_observer"] = weight_observer
    return GPTQModifier(targets="Linear", scheme=scheme, ignore=list(IGNORE) + [f"re:{r}" for r in ignore], **extra)


def smoothquant_modifier() -> Any:
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    return SmoothQuantModifier(mappings=SALA_SMOOTHQUANT_MAPPINGS)


def run_oneshot(model: Any, tokenizer: Any, dataset: Any, recipe: list[Any], pipeline: str, max_len: int) -> Any:
    from llmcompressor import oneshot

    return oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(dataset),
        max_seq_length=max_len,
        shuffle_calibration_samples=False,
        batch_size=1,
        pipeline=pipeline,
    )


def quantized_linears(model: Any) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and getattr(module, "quantization_scheme", None) is not None
    }


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight the quantized module computes with: compressed-tensors' fake quantization of the stored
    weight with the module's ``weight_scale`` / ``weight_zero_point`` (or the decoded packed weight)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import dequantize, forward_quantize

    args = module.quantization_scheme.weights
    status = module.quantization_status
    packed = getattr(module, "weight_packed", None)
    if packed is not None:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        shape = torch.Size(module.weight_shape.tolist())
        q = unpack_from_int32(packed, args.num_bits, shape)
        return dequantize(q, module.weight_scale, getattr(module, "weight_zero_point", None), args).float()
    weight = module.weight.data
    if status >= QuantizationStatus.COMPRESSED:
        return weight.float()
    return forward_quantize(module, weight, "weight", args).float()


def smoothing_factors(source: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], linear: str):
    """Per-input-channel factor the smoothing multiplied ``linear``'s weight by (None when not smoothed):
    the ratio of the source norm weight to the smoothed one, for the linears read after a norm."""
    parent, _, leaf = linear.rpartition(".")
    layer = parent.rpartition(".")[0]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_gate", "z_proj"):
        norm = f"{layer}.input_layernorm.weight"
    elif leaf in ("gate_proj", "up_proj"):
        norm = f"{layer}.post_attention_layernorm.weight"
    else:
        return None
    if norm not in source or norm not in model_state:
        return None
    return source[norm].float() / model_state[norm].float()


def input_scales(model: Any) -> dict[str, float]:
    """Per quantized linear, the activation scale in ModelOpt's convention (``1 / input_global_scale``), for
    schemes that quantize activations (empty otherwise)."""
    return {
        name: float(1.0 / module.input_global_scale.float().reshape(-1)[0])
        for name, module in quantized_linears(model).items()
        if getattr(module, "input_global_scale", None) is not None
    }


def export(
    model: Any, source_dir: Path, out: Path, smoothquant: bool, scheme: str
) -> tuple[dict[str, Any], list[str], dict[str, torch.Tensor]]:
    """Write config, tokenizer and ``model.safetensors`` (source names, bf16); return the check figures,
    the names of the source linears kept in bf16 and the written tensors."""
    group_size, max_allowed, _ = SCHEMES[scheme]
    quantized = quantized_linears(model)
    if not quantized:
        raise RuntimeError("oneshot left no module with a quantization_scheme: nothing was quantized")
    source = read_source(source_dir)
    state = {name: t.detach() for name, t in model.state_dict().items()}

    tensors: dict[str, torch.Tensor] = {}
    per_module: dict[str, dict[str, float]] = {}
    max_levels = 0
    for name, ref in source.items():
        module_name = name.removesuffix(".weight")
        if name.endswith(".weight") and module_name in quantized:
            w = dequantized_weight(quantized[module_name])
            if tuple(w.shape) != tuple(ref.shape):
                raise RuntimeError(f"{module_name}: dequantized weight {list(w.shape)} != source {list(ref.shape)}")
            levels = levels_per_group(w, group_size)
            max_levels = max(max_levels, levels)
            basis = ref.float()
            factors = smoothing_factors(source, state, module_name) if smoothquant else None
            if factors is not None:
                basis = basis * factors[None, :]
            err = float((w - basis).norm() / basis.norm().clamp_min(1e-12))
            stored = quantized[module_name].weight.data.float()
            per_module[module_name] = {
                "levels": levels,
                "rel_error": err,
                "stored_vs_dequantized_max_abs": float((stored - w).abs().max()),
            }
            tensors[name] = w.to(ref.dtype).contiguous()
        else:
            if name not in state:
                raise RuntimeError(f"source tensor {name} has no counterpart in the oneshot model's state dict")
            t = state[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise RuntimeError(f"{name}: model tensor {list(t.shape)} != source {list(ref.shape)}")
            tensors[name] = t.to(ref.dtype).clone().contiguous()
    kept = kept_linears(model, source, quantized)
    if max_levels > max_allowed:
        worst = max(per_module, key=lambda n: per_module[n]["levels"])
        raise RuntimeError(f"{worst}: {max_levels} distinct values in a group of {group_size} ({scheme} allows "
                           f"{max_allowed})")  # fmt: skip

    write_checkpoint(source_dir, out, tensors, input_scales(model))

    checks = {
        "quantized_linears": len(quantized),
        "max_levels_per_group": max_levels,
        **weight_errors(per_module),
        "stored_vs_dequantized_max_abs": max(m["stored_vs_dequantized_max_abs"] for m in per_module.values()),
        "per_module": per_module,
    }
    return checks, kept, tensors


# --------------------------------------------------------------------------------------------- main


def failure_record(exc: BaseException, step: str) -> dict[str, Any]:
    """peer.json of a failed run, pointing at the llm-compressor / compressed-tensors / transformers frame."""
    return _failure_record(exc, step, "llm-compressor", "llmcompressor", PEER_PACKAGES[:3])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    step = Step()
    t_start = time.perf_counter()
    notes: list[str] = []
    try:
        with step("import llmcompressor"):
            import llmcompressor  # noqa: F401

        with step("load model (AutoModelForCausalLM)"):
            model = load_hf_model(args.model, args.attention_mode)
            notes.append(
                f"model.attention_mode = {args.attention_mode!r} during calibration (salaquant's calibration mode)"
            )

        with step("calibration data (salaquant.calibration.calib_data.load_calibration)"):
            tokenizer, dataset, calib_info = calibration_dataset(
                args.model, args.calib, args.max_samples, args.max_len, not args.no_bos
            )

        observer = f", weight observer {args.weight_observer}" if args.weight_observer else ""
        recipe_names = (["SmoothQuantModifier"] if args.smoothquant else []) + [f"GPTQModifier {args.scheme}{observer}"]
        with step(f"oneshot ({' + '.join(recipe_names)}, pipeline {args.pipeline})"):
            t0 = time.perf_counter()
            if args.pipeline == "sequential":
                # llm-compressor's "independent" pipeline gives each modifier its own sequential pass, so the
                # GPTQ Hessians are collected on the already smoothed model.
                recipe = ([smoothquant_modifier()] if args.smoothquant else []) + [
                    gptq_modifier(args.ignore, args.scheme, args.weight_observer)
                ]
                model = run_oneshot(model, tokenizer, dataset, recipe, "independent", args.max_len)
                pipeline = "independent (sequential per modifier)" if args.smoothquant else "sequential"
            else:
                if args.smoothquant:
                    model = run_oneshot(model, tokenizer, dataset, [smoothquant_modifier()], "basic", args.max_len)
                gptq = gptq_modifier(args.ignore, args.scheme, args.weight_observer)
                model = run_oneshot(model, tokenizer, dataset, [gptq], "basic", args.max_len)
                pipeline = "basic"
            oneshot_s = time.perf_counter() - t0

        with step("export (dequantize and write model.safetensors)"):
            checks, kept, _ = export(model, args.model, args.out, args.smoothquant, args.scheme)

        with step("forward check (in-memory quantized model vs written checkpoint)"):
            probe = torch.tensor(dataset[0]["input_ids"][:256], dtype=torch.int64)
            check = forward_check(model, args.model, args.out, probe, args.attention_mode)
            logit_diff = check["max_abs_logit_diff"]
            notes.append(
                f"max |logit| difference, llm-compressor's in-memory model vs the written checkpoint "
                f"(first calibration sample, 256 tokens): {logit_diff:.3g}"
            )
            if "kl_in_memory" in check:
                notes.append(
                    f"W4A4 on the same tokens, KL(source || q): llm-compressor's in-memory model "
                    f"{check['kl_in_memory']:.4f}, the written checkpoint with the scorer's FP4 activations "
                    f"{check['kl_written_emulated']:.4f}"
                )

        if args.smoothquant:
            notes.append(
                "SmoothQuant mappings given explicitly: input_layernorm -> q/k/v + o_gate|z_proj, "
                "post_attention_layernorm -> gate/up (llm-compressor has no mappings for this architecture and "
                "its default ones omit the output gates); weight error measured against the smoothed source weight"
            )
        notes.append(
            f"calibration: {calib_info['samples']} samples, {calib_info['tokens']} tokens, "
            f"fingerprint {calib_info['fingerprint'][:16]}"
        )
        per_module = checks.pop("per_module")
        record = {
            "tool": "llm-compressor",
            "version": version("llmcompressor"),
            "compressed_tensors": version("compressed-tensors"),
            "transformers": version("transformers"),
            "torch": version("torch"),
            "scheme": f"{args.scheme} ({SCHEMES[args.scheme][2]}; GPTQModifier defaults otherwise)",
            "smoothquant": bool(args.smoothquant),
            "weight_observer": args.weight_observer or "the scheme's",
            "pipeline": pipeline,
            "seconds": round(oneshot_s, 1),
            "total_seconds": round(time.perf_counter() - t_start, 1),
            "quantized_linears": checks.pop("quantized_linears"),
            "kept_bf16": kept,
            "max_levels_per_group": checks.pop("max_levels_per_group"),
            **checks,
            "calibration": calib_info,
            "forward_check_max_abs_logit_diff": logit_diff,
            "forward_check": check,
            "notes": notes,
            "per_module": per_module,
        }
        (args.out / "peer.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "per_module"}, indent=2))
        return 0
    except Exception as exc:
        record = failure_record(exc, step.name)
        (args.out / "peer.json").write_text(json.dumps(record, indent=2) + "\n")
        print(record["traceback_tail"], file=sys.stderr)
        print(f"llm-compressor peer failed in {record['where']}: {record['error']}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
