"""Peer runner: AutoRound (SignRound: signed-gradient tuning of each weight's rounding and of the scales' clipping,
block by block) on a SALA checkpoint, on the CPU or a CUDA GPU: W4A16, NVFP4 weight-only (NVFP4A16) or NVFP4 W4A4.

Runs inside the virtual environment made by ``benchmarks/peers/setup_autoround.sh``::

    python benchmarks/peers/autoround.py --model models/sala-tiny --calib calib/sala-tiny-calib.jsonl \\
        --max-samples 32 --max-len 2048 --out OUT [--scheme W4A16|NVFP4A16|NVFP4|<AutoRound preset>]
        [--iters 200] [--device cpu|cuda] [--ignore REGEX ...]

The model is loaded with ``AutoModelForCausalLM`` (after ``import salaquant.model.hf``) and handed to
``auto_round.AutoRound`` as a module, with SignRound's settings at AutoRound's defaults (``iters`` 200, learning
rate 1 / iters, min-max tuning on, each block tuned on the previous blocks' quantized outputs, seed 42) except:

* the calibration data are the token sequences ``salaquant.calibration.calib_data.load_calibration`` gives (so every
  tool sees the same tokens), passed as AutoRound's ``dataset``, which takes a list of token tensors as they are;
  ``nsamples`` is their number and ``seqlen`` their shortest length, since AutoRound drops a sample shorter than
  ``seqlen`` (a token tensor is not cut to it);
* the samples differ in length, so they cannot be stacked: ``batch_size=1`` with ``gradient_accumulate_steps=8``
  (AutoRound's advice for models it cannot batch), which keeps its default of 8 samples a step;
* ``torch.compile`` off (AutoRound turns it on from 10 iters on; on a 2-core CPU the first lightning block had not
  finished after 4 minutes with it, where without it a block tunes in under a minute at 10 iters), on either device,
  so that a GPU run computes what a CPU run does. ``--device`` is AutoRound's ``device_map`` (``cpu`` by default;
  ``cuda``: each block is tuned on the GPU, which makes the default 200 steps a matter of minutes); the model is
  back on the CPU for the export and its checks.

``--iters``: AutoRound's docs give 200 as the default ("auto-round", the recipe they recommend for W4A16), 0 for its
round-to-nearest mode, 50 with ``--lr`` 5e-3 as the faster "auto-round-light" and 1000 for "auto-round-best".

Schemes: ``W4A16`` is AutoRound's preset (int4, symmetric, group 128); ``NVFP4`` its preset (NVFP4 weights, FP4
activations in blocks of 16 with dynamic block scales and one static global scale per linear from the largest
activation seen in calibration); ``NVFP4A16`` the same NVFP4 weights with 16-bit activations (AutoRound has no preset
of that name); any other name is taken as an AutoRound preset. ``--ignore`` regexes (``re.match`` on module names,
as GPTQ's ``dynamic`` rules) keep linears in bf16 through AutoRound's ``layer_config``; lm_head is never quantized.

Two adapters fit SALA to how AutoRound replays decoder blocks, neither changing what the model computes:

* AutoRound passes each sample with an attention mask whose last position is 0 (so that no mask is all ones); the
  SALA class refuses any mask with a zero (it has no padding) and the samples have none, so a pre-forward hook drops
  the mask. AutoRound still leaves each sample's last position out of its loss (its own token mask).
* AutoRound captures the first decoder layer's extra inputs and replays every block with them; SALA's layers take
  their RoPE table as such an input, and the first layer (minicpm4) takes none where the lightning layers need
  theirs, so each decoder layer computes its own table from its input's length, as the model's cache-less forward
  does.

OUT then holds a plain bf16 checkpoint that salaquant reads: ``config.json`` and the tokenizer files copied from
the source, and ``model.safetensors`` with every tensor of the source under the same name, each quantized linear's
weight replaced by the weight AutoRound's quantized module computes with (its fake-quantized weight, which AutoRound
leaves in the module after ``quantize()``); for W4A4 ``input_scales.json`` holds each quantized linear's activation
scale in ModelOpt's convention (``input_scale``: the largest activation / (6 x 448), i.e. ``1 / input_global_scale``
with AutoRound's global scale from ``auto_round.data_type.nvfp.calculate_gparam``, the one its exporters write; the
linears AutoRound's exporters would give one shared scale read the same input, so theirs are equal already).
``OUT/peer.json`` records the run, or on failure the exception, the step and the AutoRound frame where it happened
(exit status 1).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peer_common import (
    Step,
    calibration_samples,
    failure_record,
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

SCHEMES: dict[str, str] = {
    "W4A16": "AutoRound preset W4A16: int4 symmetric, group 128, 16-bit activations",
    "NVFP4A16": "NVFP4 weights (E2M1, FP8 scales per 16, global scale), 16-bit activations",
    "NVFP4": "AutoRound preset NVFP4: NVFP4 weights and activations (W4A4; activation block scales dynamic, "
    "global scale static from calibration)",
}
DEFAULT_ITERS = 200
"""AutoRound's default number of tuning steps per block (``SignRoundConfig.iters``)."""
GRADIENT_ACCUMULATE_STEPS = 8
"""Samples per tuning step: AutoRound's default batch of 8, as 8 accumulated batches of one sample."""
SEED = 42
"""AutoRound's default seed."""
PEER_PACKAGES = ("auto_round", "transformers", "accelerate")
"""Module frames of these packages are the ones "where" points at on failure."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = peer_arguments(__doc__)
    ap.add_argument(
        "--scheme", default="W4A16", help=f"{', '.join(SCHEMES)} (see above) or another AutoRound preset name"
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=DEFAULT_ITERS,
        help="tuning steps per block (AutoRound's default 200; 0: its round-to-nearest mode)",
    )
    ap.add_argument("--lr", type=float, default=None, help="learning rate (AutoRound's default: 1 / iters)")
    ap.add_argument("--device", default="cpu", help="AutoRound's device_map: cpu (default) or cuda")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------- steps


def scheme_for(name: str) -> Any:
    """What ``AutoRound(scheme=...)`` is given for ``name``: the preset's name, or for NVFP4A16 AutoRound's NVFP4
    weight settings with activations left at 16 bits."""
    from auto_round.schemes import QuantizationScheme, is_preset_scheme

    if name == "NVFP4A16":
        return QuantizationScheme(bits=4, group_size=16, sym=True, data_type="nv_fp", act_bits=16)
    if not is_preset_scheme(name):
        raise ValueError(f"unknown scheme {name!r}: use {', '.join(SCHEMES)} or an AutoRound preset name")
    return name


def adapt_model(model: Any) -> None:
    """Fit SALA to AutoRound's replay without changing what it computes (module docstring): drop the attention
    mask AutoRound passes, and have each decoder layer compute its own RoPE table."""
    from salaquant.model.modeling import DecoderLayer, layer_rope

    def drop_mask(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs.pop("attention_mask", None)
        return args, kwargs

    model.register_forward_pre_hook(drop_mask, with_kwargs=True)
    config = model.sala_config
    for layer in model.model.layers:

        def forward(
            h: torch.Tensor, rope: Any = None, cache: Any = None, mode: str = "auto", layer: Any = layer
        ) -> torch.Tensor:
            table = layer_rope(config, layer.kind, 0, h.shape[1], h.device) if cache is None else rope
            return DecoderLayer.forward(layer, h, table, cache, mode)

        layer.forward = forward


def kept_in_bf16(model: Any, regexes: list[str]) -> list[str]:
    """Linears (besides lm_head) whose name one of ``regexes`` ``re.match``-es."""
    return sorted(
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and any(re.match(r, name) for r in regexes)
    )


def run_autoround(
    model: Any, tokenizer: Any, samples: list[torch.Tensor], scheme: Any, kept: list[str], args: argparse.Namespace
) -> Any:
    """AutoRound's ``quantize()`` on the samples; returns the compressor (its model holds the quantized weights)."""
    from auto_round import AutoRound, SignRoundConfig

    algorithm = SignRoundConfig(iters=args.iters, lr=args.lr, gradient_accumulate_steps=GRADIENT_ACCUMULATE_STEPS)
    bf16 = {"bits": 16, "act_bits": 16, "data_type": "float", "act_data_type": "float"}
    compressor = AutoRound(
        model,
        tokenizer=tokenizer,
        scheme=scheme,
        alg_configs=algorithm,
        layer_config={name: dict(bf16) for name in kept},
        dataset=[ids[None] for ids in samples],
        nsamples=len(samples),
        seqlen=min(len(ids) for ids in samples),
        batch_size=1,
        device_map=args.device,
        seed=SEED,
        enable_torch_compile=False,
    )
    compressor.quantize()
    return compressor


def on_cpu(model: Any) -> Any:
    """``model`` with its parameters, buffers and every tensor its modules hold as plain attributes (AutoRound keeps
    scales and activation ranges so) on the CPU, where the export and its checks run."""
    model.to("cpu")
    for module in model.modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                setattr(module, key, value.to("cpu"))
    return model


def quantized_linears(model: Any) -> dict[str, torch.nn.Linear]:
    """Linears AutoRound quantized (4- or 8-bit ``bits`` attribute), by the module name of the source model: a
    W4A4 linear stays wrapped in AutoRound's activation quantizer, with the linear as its ``orig_layer``."""
    found = {}
    for name, module in model.named_modules():
        layer = getattr(module, "orig_layer", module)
        if name.endswith(".orig_layer") or not isinstance(layer, torch.nn.Linear):
            continue
        bits = getattr(layer, "bits", None)
        if isinstance(bits, int) and bits <= 8:
            found[name] = layer
    return found


def input_scales(quantized: dict[str, torch.nn.Linear]) -> dict[str, float]:
    """Per linear whose activations AutoRound quantizes to NVFP4, the activation scale in ModelOpt's convention:
    ``1 / input_global_scale``, the global scale AutoRound's exporters derive from the largest activation seen."""
    from auto_round.data_type.nvfp import calculate_gparam

    scales = {}
    for name, layer in quantized.items():
        act_bits = getattr(layer, "act_bits", None) or 16
        if act_bits <= 8 and "nv_fp" in str(getattr(layer, "act_data_type", "")):
            global_scale = calculate_gparam(layer.act_max, layer.act_group_size)
            scales[name] = float(1.0 / global_scale.float().reshape(-1)[0])
    return scales


def group_limits(layer: torch.nn.Linear) -> tuple[int, int] | None:
    """(inputs per group, most distinct values in one) of a quantized linear: E2M1 has 15 values (+-0 are one), an
    n-bit integer 2**n; None for a group layout this check does not cover."""
    group_size, bits = getattr(layer, "group_size", None), int(layer.bits)
    if not isinstance(group_size, int) or group_size <= 0 or layer.in_features % group_size:
        return None
    fp4 = "fp" in str(getattr(layer, "data_type", "")) and bits == 4
    return group_size, 15 if fp4 else 2**bits


def export(model: Any, source_dir: Path, out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Write config, tokenizer, ``model.safetensors`` (source names, bf16) and for W4A4 ``input_scales.json``;
    return the check figures (with the linears kept in bf16) and the written tensors."""
    quantized = quantized_linears(model)
    if not quantized:
        raise RuntimeError("quantize() left no linear with a 4- or 8-bit scheme: nothing was quantized")
    source = read_source(source_dir)
    state = {name.replace(".orig_layer.", "."): t.detach() for name, t in model.state_dict().items()}

    tensors: dict[str, torch.Tensor] = {}
    per_module: dict[str, dict[str, float]] = {}
    unchanged_max_abs = 0.0
    for name, ref in source.items():
        module_name = name.removesuffix(".weight")
        if name.endswith(".weight") and module_name in quantized:
            layer = quantized[module_name]
            w = layer.weight.detach().float()
            if tuple(w.shape) != tuple(ref.shape):
                raise RuntimeError(f"{module_name}: quantized weight {list(w.shape)} != source {list(ref.shape)}")
            limits = group_limits(layer)
            levels = levels_per_group(w, limits[0]) if limits else -1
            if limits and levels > limits[1]:
                raise RuntimeError(f"{module_name}: {levels} distinct values in a group of {limits[0]} "
                                   f"(its scheme allows {limits[1]})")  # fmt: skip
            basis = ref.float()
            per_module[module_name] = {
                "levels": levels,
                "rel_error": float((w - basis).norm() / basis.norm().clamp_min(1e-12)),
            }
            tensors[name] = w.to(ref.dtype).contiguous()
        else:
            if name not in state:
                raise RuntimeError(f"source tensor {name} has no counterpart in AutoRound's model")
            t = state[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise RuntimeError(f"{name}: model tensor {list(t.shape)} != source {list(ref.shape)}")
            tensors[name] = t.to(ref.dtype).clone().contiguous()
            unchanged_max_abs = max(unchanged_max_abs, float((tensors[name].float() - ref.float()).abs().max()))
    kept = kept_linears(model, source, quantized)
    scales = input_scales(quantized)
    write_checkpoint(source_dir, out, tensors, scales)

    checks = {
        "quantized_linears": len(quantized),
        "kept_bf16": kept,
        "activation_scales": len(scales),
        "max_levels_per_group": max(int(m["levels"]) for m in per_module.values()),
        **weight_errors(per_module),
        "other_tensors_max_abs_change": unchanged_max_abs,
        "per_module": per_module,
    }
    return checks, tensors


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    step = Step()
    t_start = time.perf_counter()
    notes: list[str] = []
    try:
        with step("import auto_round"):
            import auto_round  # noqa: F401

        with step("scheme"):
            scheme = scheme_for(args.scheme)

        with step("load model (AutoModelForCausalLM)"):
            model = load_hf_model(args.model, args.attention_mode)
            adapt_model(model)
            kept = kept_in_bf16(model, args.ignore)
            notes.append(
                f"model.attention_mode = {args.attention_mode!r} during calibration (salaquant's calibration mode)"
            )

        with step("calibration data (salaquant.calibration.calib_data.load_calibration)"):
            tokenizer, samples, calib_info = calibration_samples(
                args.model, args.calib, args.max_samples, args.max_len, not args.no_bos
            )

        with step(f"AutoRound quantize ({args.scheme}, iters {args.iters})"):
            t0 = time.perf_counter()
            compressor = run_autoround(model, tokenizer, samples, scheme, kept, args)
            quantize_s = time.perf_counter() - t0
            model = on_cpu(compressor.model)

        with step("export (fake-quantized weights to model.safetensors)"):
            checks, _ = export(model, args.model, args.out)

        with step("forward check (in-memory quantized model vs written checkpoint)"):
            check = forward_check(model, args.model, args.out, samples[0][:256], args.attention_mode)
            notes.append(
                f"max |logit| difference, AutoRound's in-memory model vs the written checkpoint "
                f"(first calibration sample, 256 tokens): {check['max_abs_logit_diff']:.3g}"
            )
            if "kl_in_memory" in check:
                notes.append(
                    f"W4A4 on the same tokens, KL(source || q): AutoRound's in-memory model "
                    f"{check['kl_in_memory']:.4f}, the written checkpoint with the scorer's FP4 activations "
                    f"{check['kl_written_emulated']:.4f}"
                )
        notes.append(
            f"calibration: {calib_info['samples']} samples, {calib_info['tokens']} tokens, "
            f"fingerprint {calib_info['fingerprint'][:16]}; AutoRound dataset = these token tensors, "
            f"nsamples {len(samples)}, seqlen {min(len(s) for s in samples)} (the shortest sample)"
        )
        per_module = checks.pop("per_module")
        record = {
            "tool": "AutoRound",
            "version": version("auto-round"),
            "transformers": version("transformers"),
            "torch": version("torch"),
            "scheme": f"{args.scheme} ({SCHEMES.get(args.scheme, 'AutoRound preset')})",
            "algorithm": "SignRound (AutoRound's default)",
            "iters": args.iters,
            "lr": args.lr if args.lr is not None else "1 / iters (AutoRound's default)",
            "batch": f"batch_size 1 x gradient_accumulate_steps {GRADIENT_ACCUMULATE_STEPS}",
            "seed": SEED,
            "torch_compile": False,
            "device": args.device,
            "seconds": round(quantize_s, 1),
            "total_seconds": round(time.perf_counter() - t_start, 1),
            **checks,
            "calibration": calib_info,
            "forward_check_max_abs_logit_diff": check["max_abs_logit_diff"],
            "forward_check": check,
            "notes": notes,
            "per_module": per_module,
        }
        (args.out / "peer.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "per_module"}, indent=2))
        return 0
    except Exception as exc:
        record = failure_record(exc, step.name, "AutoRound", "auto-round", PEER_PACKAGES)
        (args.out / "peer.json").write_text(json.dumps(record, indent=2) + "\n")
        print(record["traceback_tail"], file=sys.stderr)
        print(f"AutoRound peer failed in {record['where']}: {record['error']}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
