"""Peer runner: GPTQModel's GPTQ W4A16 on a MiniCPM-SALA checkpoint, on the CPU, exported as a bf16 checkpoint.

Runs in the environment made by ``benchmarks/peers/setup_gptqmodel.sh`` (GPTQModel, torch CPU, salaquant
installed without its dependencies)::

    python benchmarks/peers/gptqmodel_gptq.py --model models/sala-tiny --calib calib/sala-tiny-calib.jsonl \\
        --max-samples 32 --max-len 2048 --out OUT

What it does:

* describes SALA to GPTQModel with salaquant's definition (``salaquant.model.gptqmodel_definition.SalaQModel``,
  the one ``GPTQModel.load`` uses for our exports): the layer tree of both mixer kinds, and the decoder layers'
  own arguments rebuilt for each layer when GPTQModel replays its cached inputs;
* quantizes with GPTQModel's GPTQ defaults (bits 4, group 128, symmetric, its default damping and its
  default activation ordering), on the calibration samples salaquant builds
  (``salaquant.calibration.calib_data.load_calibration``), one sample per batch (SALA takes no padding);
* writes OUT/model.safetensors with every tensor of the source checkpoint under the same name, each
  quantized linear replaced by the weight the packed GPTQ tensors decode to (bf16), plus config.json and
  the tokenizer files copied from the source, and OUT/peer.json (settings, time, checks). On failure
  OUT/peer.json holds the error, the step and the GPTQModel function where it happened, and the exit
  status is 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class PeerError(RuntimeError):
    """A check of this runner failed (not an exception raised inside GPTQModel)."""


def build_definition() -> type:
    """salaquant's GPTQModel definition of MiniCPM-SALA (imported lazily: gptqmodel is slow to import)."""
    from salaquant.model.gptqmodel_definition import SalaQModel

    return SalaQModel


def unpack_gptq_v1(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Dequantize GPTQ v1 tensors (int32-packed along the input dimension, zero points stored minus one) to an
    fp32 [out, in] weight. Each input row's group comes from ``g_idx``, so an act-order permutation is honoured."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [in/per_word, per_word, out]
    codes = codes.reshape(-1, qweight.shape[1])  # [in, out]
    zeros = (qzeros.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask  # [groups, out/per_word, per_word]
    zeros = zeros.reshape(qzeros.shape[0], -1)[:, : scales.shape[1]] + 1  # v1 stores zero - 1
    g = g_idx.long()
    weight = scales.float()[g] * (codes.float() - zeros.float()[g])
    return weight.t().contiguous()


def max_levels_per_group(weight: torch.Tensor, g_idx: torch.Tensor) -> int:
    """Largest number of distinct values in one (output row, g_idx group) of ``weight`` [out, in]."""
    order = torch.argsort(g_idx.long(), stable=True)
    sizes = torch.bincount(g_idx.long())
    w = weight[:, order]
    worst = 0
    start = 0
    for size in sizes.tolist():
        block = w[:, start : start + size]
        start += size
        if size == 0:
            continue
        s, _ = torch.sort(block, dim=1)
        distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(dim=1)
        worst = max(worst, int(distinct.max()))
    return worst


def innermost_frame(tb: Any, package: str) -> str | None:
    """``function (file:line)`` of the innermost traceback frame inside ``package`` (or None)."""
    found = None
    for frame in traceback.extract_tb(tb):
        if f"/{package}/" in frame.filename:
            path = frame.filename.split(f"/{package}/", 1)[1]
            found = f"{frame.name} ({package}/{path}:{frame.lineno})"
    return found


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def config_summary(qcfg: Any) -> dict[str, Any]:
    """The QuantizeConfig fields that decide the result, read back from the object GPTQModel used."""
    keys = (
        "method",
        "format",
        "bits",
        "group_size",
        "sym",
        "desc_act",
        "act_group_aware",
        "static_groups",
        "damp_percent",
        "damp_auto_increment",
        "true_sequential",
        "mse",
        "lm_head",
        "pack_dtype",
        "rotation",
        "gptaq",
        "foem",
        "device",
    )
    out: dict[str, Any] = {"class": type(qcfg).__name__}
    for key in keys:
        if hasattr(qcfg, key):
            value = getattr(qcfg, key)
            out[key] = value.value if hasattr(value, "value") else value
    out["fallback"] = repr(getattr(qcfg, "fallback", None))
    out["hessian"] = repr(getattr(qcfg, "hessian", None))
    return {k: (v if isinstance(v, (int, float, bool, str, type(None))) else str(v)) for k, v in out.items()}


def run(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    notes: list[str] = []
    torch.set_num_threads(args.threads)

    state["where"] = "import gptqmodel"
    # GPTQModel sizes its CPU worker pool as (cores + 1) // 2 but always asks for a 2-worker model-loader pool
    # under it, which fails on a machine with fewer than 3 cores (gptqmodel/utils/threadx.py: "Virtual pool
    # 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1"); GPTQMODEL_CPU_WORKERS overrides it.
    if (os.cpu_count() or 1) < 3 and "GPTQMODEL_CPU_WORKERS" not in os.environ:
        os.environ["GPTQMODEL_CPU_WORKERS"] = "2"
        notes.append(
            "GPTQMODEL_CPU_WORKERS=2 set: GPTQModel's default CPU pool (1 worker on 2 cores) is smaller "
            "than the 2-worker model-loader pool it creates under it, and pool creation fails"
        )
    import gptqmodel
    from gptqmodel import QuantizeConfig
    from safetensors import safe_open
    from safetensors.torch import save_file

    import salaquant.model.hf  # noqa: F401  (registers model_type minicpm_sala with transformers)
    from salaquant.calibration.calib_data import CalibOptions, load_calibration
    from salaquant.io.reader import CheckpointReader
    from salaquant.workflow import load_tokenizer

    version = importlib.metadata.version("gptqmodel")
    state["version"] = version

    state["where"] = "calibration: salaquant.calibration.calib_data.load_calibration"
    tok = load_tokenizer(args.model)
    options = CalibOptions(max_samples=args.max_samples, max_len=args.max_len, bos=not args.no_bos)
    calib = load_calibration([str(args.calib)], tok, options)
    samples = [{"input_ids": s.ids.tolist(), "attention_mask": [1] * len(s)} for s in calib]
    summary = calib.summary()
    notes.append(
        f"calibration: {summary['samples']} samples, {summary['tokens']} tokens (lengths {summary['min_len']}-"
        f"{summary['max_len']}), fingerprint {calib.fingerprint()[:16]}; passed to quantize() as input_ids, "
        "batch_size=1, calibration_data_min_length=1 (GPTQModel's default of 10 would drop shorter samples)"
    )

    state["where"] = "QuantizeConfig (gptqmodel/quantization/config.py)"
    # "-:" entries of ``dynamic`` are GPTQModel's documented way to leave matching modules unquantized.
    dynamic = {f"-:{regex}": {} for regex in args.ignore} or None
    qcfg = QuantizeConfig(bits=4, group_size=128, sym=True, device="cpu", dynamic=dynamic)
    state["quantize_config"] = config_summary(qcfg)

    state["where"] = "load: SalaQModel.from_pretrained (gptqmodel/models/loader.py)"
    definition = build_definition()
    t0 = time.perf_counter()
    qmodel = definition.from_pretrained(str(args.model), quantize_config=qcfg, trust_remote_code=False)
    load_s = time.perf_counter() - t0
    hf_model = qmodel.model
    hf_model.attention_mode = "dense"  # what salaquant calibrates with (EngineOptions.attention_mode)
    notes.append(f"model loaded by GPTQModel in dtype {next(hf_model.parameters()).dtype}")

    state["where"] = "quantize: BaseQModel.quantize (gptqmodel/models/base.py)"
    t0 = time.perf_counter()
    qmodel.quantize(samples, batch_size=1, calibration_data_min_length=1)
    quantize_s = time.perf_counter() - t0
    state["quantize_config"] = config_summary(qmodel.quantize_config)

    state["where"] = "read the packed modules"
    packed = sorted(name for name, module in hf_model.named_modules() if hasattr(module, "qweight"))
    if not packed:
        raise PeerError("no module of the quantized model has a qweight: nothing was quantized")

    with tempfile.TemporaryDirectory(prefix="gptqmodel-save-") as scratch:
        tmp = str(args.keep_gptq) if args.keep_gptq else scratch
        # The quantized modules are offloaded to disk as they are finished (offload_to_disk=True, the default),
        # so the packed tensors are read from the checkpoint GPTQModel writes.
        state["where"] = "save: BaseQModel.save (gptqmodel/models/base.py)"
        qmodel.save(tmp)
        tensors_v1: dict[str, torch.Tensor] = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    tensors_v1[key] = f.get_tensor(key)
        saved_cfg = json.loads((Path(tmp) / "config.json").read_text()).get("quantization_config", {})
        notes.append(f"GPTQModel checkpoint quantization_config: {json.dumps(saved_cfg, default=str)}")
        quant_log = Path(tmp) / "quant_log.csv"
        if quant_log.exists():
            rows = [line.split(",") for line in quant_log.read_text().splitlines()[1:] if line.strip()]
            damps = sorted({row[4] for row in rows if len(row) > 4})
            notes.append(f"quant_log.csv: {len(rows)} modules, damp values used {damps}")
        checkpoint_format = str(saved_cfg.get("checkpoint_format", saved_cfg.get("format", "gptq")))
        if checkpoint_format not in ("gptq", "FORMAT.GPTQ"):
            raise PeerError(f"GPTQModel wrote checkpoint format {checkpoint_format!r}, expected GPTQ v1 ('gptq')")
        # Cross-check: the same checkpoint loaded back by GPTQModel (torch kernel), its own dequantize_weight().
        state["where"] = "cross-check: SalaQModel.from_quantized (gptqmodel/models/loader.py)"
        runtime: dict[str, torch.Tensor] = {}
        runtime_dtype = ""
        try:
            reloaded = definition.from_quantized(tmp, device="cpu", backend="torch", trust_remote_code=False)
            for name, module in reloaded.model.named_modules():
                if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
                    runtime_w = module.dequantize_weight().detach()
                    runtime_dtype = str(runtime_w.dtype)
                    runtime[name] = runtime_w.float().cpu().t()
            del reloaded
        except Exception as exc:
            notes.append(f"cross-check skipped: from_quantized failed ({type(exc).__name__}: {exc})")

    state["where"] = "dequantize and check"
    with CheckpointReader(args.model) as reader:  # one file or the shards its index lists
        source = {k: reader.get(k) for k in reader.keys()}  # noqa: SIM118
    source_keys = list(source)
    bits = int(qcfg.bits)
    out_tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    levels: dict[str, int] = {}
    max_mismatch = 0.0
    same = total = 0
    nontrivial_gidx: list[str] = []
    num_sq = den_sq = 0.0
    for name in packed:
        key = f"{name}.weight"
        if key not in source:
            raise PeerError(f"quantized module {name} has no tensor {key} in the source checkpoint")
        if f"{name}.qweight" not in tensors_v1:
            raise PeerError(f"{name}.qweight is missing from the checkpoint GPTQModel saved")
        original = source[key].float()
        g_idx = tensors_v1[f"{name}.g_idx"]
        if not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // int(qcfg.group_size)):
            nontrivial_gidx.append(name)
        weight = unpack_gptq_v1(
            tensors_v1[f"{name}.qweight"], tensors_v1[f"{name}.qzeros"], tensors_v1[f"{name}.scales"], g_idx, bits
        )
        if weight.shape != original.shape:
            raise PeerError(f"{name}: dequantized shape {tuple(weight.shape)} != source {tuple(original.shape)}")
        deq = weight.to(torch.bfloat16)
        if name in runtime:
            # relative to the largest weight of the linear: GPTQModel dequantizes in the model dtype (bf16 here)
            rt = runtime[name][:, : weight.shape[1]]
            max_mismatch = max(max_mismatch, float((weight - rt).abs().max() / weight.abs().max()))
            same += int((deq.float() == rt).sum())
            total += deq.numel()
        lv = max_levels_per_group(deq.float(), g_idx)
        levels[name] = lv
        if lv > 2**bits:
            raise PeerError(f"{name}: {lv} distinct values in one group (> {2**bits})")
        diff = deq.float() - original
        errors[name] = float(diff.norm() / original.norm())
        num_sq += float(diff.square().sum())
        den_sq += float(original.square().sum())
        out_tensors[key] = deq.contiguous()
    if runtime:
        if set(runtime) != set(packed):
            raise PeerError(f"reloaded model quantizes {sorted(runtime)}, the quantized one {packed}")
        notes.append(
            "written weights: the GPTQ v1 tensors GPTQModel saved, decoded here through g_idx (zero = stored + 1); "
            "they match GPTQModel's own dequantize_weight() of the checkpoint reloaded with from_quantized "
            f"(torch backend, which returns {runtime_dtype}): {100 * same / total:.2f}% of the bf16 weights "
            f"identical, max |diff| / max |W| {max_mismatch:.3g} (GPTQModel casts the fp16 scales to bf16 before "
            "multiplying, a second rounding; the weights written here are the exact products rounded once)"
        )
        if max_mismatch > 1e-2:  # a bf16 rounding is at most 2**-8 of the largest value
            raise PeerError(f"decoded weights differ from GPTQModel's dequantize_weight() by {max_mismatch:.3g}")
    notes.append(
        "g_idx: "
        + (f"non-trivial in {len(nontrivial_gidx)} linears" if nontrivial_gidx else "trivial (i // group_size)")
        + f" (desc_act={qcfg.desc_act}, act_group_aware={getattr(qcfg, 'act_group_aware', None)})"
    )

    kept: list[str] = []
    for key in source_keys:
        if key not in out_tensors:
            out_tensors[key] = source[key].contiguous()
            kept.append(key)
    expected_linears = {
        k for k in source_keys if k.startswith("model.layers.") and k.rsplit(".", 2)[-2].endswith(("proj", "gate"))
    }
    missing = sorted(expected_linears - {f"{n}.weight" for n in packed})
    if missing:
        notes.append(f"layer linears GPTQModel left unquantized: {missing}")

    state["where"] = "write the checkpoint"
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: out_tensors[k] for k in source_keys}, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((args.model / "config.json").read_text())
    config.pop("quantization_config", None)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (args.model / name).exists():
            shutil.copy2(args.model / name, args.out / name)

    rel = sorted(errors.values())
    notes.append(
        "relative weight error ||W_q - W||_F / ||W||_F over the quantized linears: overall "
        f"{(num_sq / den_sq) ** 0.5:.4f}, per linear mean {sum(rel) / len(rel):.4f}, "
        f"min {rel[0]:.4f}, max {rel[-1]:.4f}"
    )
    notes.append(f"distinct values per (row, group): max {max(levels.values())} (<= 16 for every quantized linear)")
    notes.append(
        "module_tree lists the union of both layer kinds' linears (o_gate: minicpm4 only, z_proj: lightning only) "
        "with layer_modules_strict=False, so each layer quantizes only the names it has; the layers are replayed "
        "with their own RoPE tables and attention_mode='dense' (prepare_layer_replay_kwargs)"
    )
    notes.append(f"torch threads: {args.threads}; load {load_s:.1f} s")
    return {
        "tool": "GPTQModel",
        "version": version,
        "gptqmodel_module": getattr(gptqmodel, "__file__", None),
        "torch": torch.__version__,
        "quantize_config": state["quantize_config"],
        "seconds": round(quantize_s, 1),
        "load_seconds": round(load_s, 1),
        "quantized_linears": len(packed),
        "quantized_linear_names": packed,
        "kept_bf16": kept,
        "relative_weight_error": {k: round(v, 5) for k, v in errors.items()},
        "max_levels_per_group": max(levels.values()),
        "calibration": {k: summary[k] for k in ("samples", "tokens", "min_len", "max_len")},
        "notes": notes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--no-bos", action="store_true", help="calibration samples without BOS (salaquant --no-bos)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ignore", nargs="*", default=[], help="module-name regexes kept in bf16 (GPTQModel dynamic '-:')")
    ap.add_argument("--keep-gptq", type=Path, help="also keep GPTQModel's own (packed GPTQ) checkpoint in this folder")
    args = ap.parse_args()
    state: dict[str, Any] = {"where": "start"}
    t0 = time.perf_counter()
    try:
        result = run(args, state)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        inner = innermost_frame(exc.__traceback__, "gptqmodel")
        where = state["where"] + (f"; innermost GPTQModel frame: {inner}" if inner else "")
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        args.out.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {
            "tool": "GPTQModel",
            "version": state.get("version"),
            "error": f"{type(exc).__name__}: {exc}",
            "where": where,
            "traceback_tail": tail,
        }
        if "quantize_config" in state:
            payload["quantize_config"] = state["quantize_config"]
        write_json(args.out / "peer.json", payload)
        print(tail, file=sys.stderr)
        print(f"GPTQModel peer failed at {where}: {payload['error']}", file=sys.stderr)
        return 1
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out / "peer.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "relative_weight_error"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
