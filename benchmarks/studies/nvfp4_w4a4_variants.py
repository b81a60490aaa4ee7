"""NVFP4 calibration choices for W4A4 (activations in FP4, as Blackwell runs the export), decided on a validation text.

Two questions, each answered by one rule fixed before any run:

1. **SmoothQuant for W4A4.** Every variant goes through ``salaquant nvfp4`` (default exclusions and ``--dense-all``)
   with the calibration set ``benchmarks/quality.py`` uses (32 samples of at most 2048 tokens), is loaded by the
   runtime with ``activations="fp4"`` and scored on the validation text and the held-out windows (both from
   ``benchmarks/studies/gptq_variants.py``: the model's held-out documents not in the shipped sample, and exactly
   quality.py's windows); the exports keep ModelOpt's max rule for ``input_scale`` (``--input-scale max``).
   Candidates: no smoothing, alpha 0.3, 0.5, 0.7, 0.85 on the method's three groups, and alpha 0.5 on all four
   groups (adding ``up_proj`` -> ``down_proj``).
2. **The input-scale estimator**, on the exports of the smoothing pick. The export's ``input_scale`` is ModelOpt's
   rule, ``max |x| / (6 * 448)`` over the calibration tokens. The alternatives are computed here from the inputs
   every NVFP4 linear sees when the calibration samples run through the W4A4 model (one value per input group:
   the linears that read the same tensor share it, as the engines require): the 99.99th and 99.9th percentile of
   the per-token absolute maximum, the MSE-optimal scale (``salaquant.nvfp4.input_scale.InputScaleSearch``, the
   ``--input-scale mse`` rule: the factor of the max, among 0.3 .. 2.0, with the least squared error of the
   quantized activations over the calibration tokens) and twice the max (headroom for
   held-out tokens above the calibrated range). Each is written into the loaded model's ``input_scale`` buffers
   and scored as above.

Rule (both questions): the candidate with the least mean per-token W4A4 KL(bf16 || quantized) on the validation
text, averaged over the default and the dense-all exports, replaces the incumbent (alpha 0.5 on three groups;
the max) only if its validation KL is lower by more than one paired standard error over the windows of both
exports; otherwise the incumbent stays. The held-out figures only confirm.

  python benchmarks/studies/nvfp4_w4a4_variants.py --out OUT [--device cuda] [--val-windows N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from scoring import CALIB, MODEL, ROOT, decide, mean, quiet, scoring_sets, slug, source_state

from salaquant.calibration.calib_data import CalibOptions, load_calibration
from salaquant.driver import run_method
from salaquant.formats.modelopt_nvfp4.numerics import input_scale
from salaquant.model.layout import input_groups
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.input_scale import InputScaleSearch, search_stride
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.linear import NVFP4Linear
from salaquant.runtime.load import load
from salaquant.workflow import load_tokenizer

THREE = ("attn_in", "attn_out", "mlp_in")
FOUR = (*THREE, "mlp_out")
SMOOTHING: list[tuple[str, float | None, tuple[str, ...]]] = [
    ("no smoothing", None, THREE),
    ("alpha 0.3", 0.3, THREE),
    ("alpha 0.5 (incumbent)", 0.5, THREE),
    ("alpha 0.7", 0.7, THREE),
    ("alpha 0.85", 0.85, THREE),
    ("alpha 0.5, four groups", 0.5, FOUR),
]
SMOOTH_INCUMBENT = "alpha 0.5 (incumbent)"
ESTIMATORS = ("max (ModelOpt, incumbent)", "p99.99 token amax", "p99.9 token amax", "MSE-optimal", "2 x max")
SCALE_INCUMBENT = ESTIMATORS[0]
EXCLUSIONS = (("default", False), ("dense-all", True))
WATCHED = (
    "salaquant/nvfp4/layer.py",
    "salaquant/nvfp4/search.py",
    "salaquant/formats/modelopt_nvfp4/numerics.py",
    "salaquant/calibration/engine.py",
    "salaquant/smooth/fold.py",
    "salaquant/calibration/stats.py",
    "salaquant/runtime/linear.py",
)


def shared_inputs(model: torch.nn.Module) -> dict[str, list[str]]:
    """NVFP4 linears grouped by the tensor they read: ``model.layers.i.<group>`` -> member module names."""
    out: dict[str, list[str]] = {}
    for i, layer in enumerate(model.model.layers):
        for g in input_groups(model.config, layer.kind):
            members = [f"model.layers.{i}.{m}" for m in g.members]
            members = [m for m in members if isinstance(model.get_submodule(m), NVFP4Linear)]
            if members:
                out[f"model.layers.{i}.{g.name}"] = members
    return out


class InputStats:
    """Per input group: every calibration token's absolute maximum, and the ``mse`` rule's search (as the nvfp4
    command runs it, with the stride its calibration-token count implies)."""

    def __init__(self, base_scale: torch.Tensor, stride: int) -> None:
        self.base = base_scale.detach().float().clone()
        self.token_amax: list[torch.Tensor] = []
        self.search = InputScaleSearch(self.base, stride)

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()
        self.token_amax.append(flat.abs().amax(-1).cpu())
        self.search.update(flat)

    def scale(self, estimator: str) -> torch.Tensor:
        amax = torch.cat(self.token_amax)
        if estimator == SCALE_INCUMBENT:
            return self.base
        if estimator == "2 x max":
            return self.base * 2
        if estimator == "MSE-optimal":
            return self.search.scale()
        q = {"p99.99 token amax": 0.9999, "p99.9 token amax": 0.999}[estimator]
        return input_scale(torch.quantile(amax.double(), q).float()).to(self.base.device)


@torch.no_grad()
def input_stats(model: torch.nn.Module, samples: list[torch.Tensor], device: str) -> dict[str, InputStats]:
    """Run the calibration samples through the W4A4 model; the statistics of each input group's (unquantized) input."""
    groups = shared_inputs(model)
    stats: dict[str, InputStats] = {}
    handles = []
    for key, members in groups.items():
        first = model.get_submodule(members[0])
        stats[key] = InputStats(first.input_scale, search_stride(sum(s.numel() for s in samples)))

        def hook(_mod: Any, args: tuple[torch.Tensor, ...], key: str = key) -> None:
            stats[key].add(args[0])

        handles.append(first.register_forward_pre_hook(hook))
    try:
        for ids in samples:
            model(ids[None].to(device), attention_mode="dense")
    finally:
        for h in handles:
            h.remove()
    return stats


def set_scales(model: torch.nn.Module, scales: dict[str, torch.Tensor]) -> None:
    for key, members in shared_inputs(model).items():
        for m in members:
            model.get_submodule(m).input_scale.copy_(scales[key].reshape(()))


def _print(console: Console, name: str, ex: str, s: dict[str, Any], seconds: float) -> None:
    v, h = s["validation"], s["heldout"]
    console.print(
        f"{name} ({ex}): validation {100 * v['ppl_increase']:+.2f}% KL {v['kl']:.4f} | "
        f"held-out {100 * h['ppl_increase']:+.2f}% KL {h['kl']:.4f} ({seconds:.0f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--val-windows", type=int, default=None, help="validation windows (default: all)")
    ap.add_argument(
        "--command-only", action="store_true", help="only the command's mse rows, with the incumbent smoothing"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    console = Console(width=max(Console().width, 170))
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dev = args.device

    _, sets, val_info = scoring_sets(args, dev)
    val, held = sets
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    samples = [s.ids for s in load_calibration([str(CALIB)], load_tokenizer(MODEL), calib).samples]

    def score(net: torch.nn.Module) -> dict[str, Any]:
        return {s.name: s.score(net) for s in sets}

    smooth_rows: list[dict[str, Any]] = []
    for name, alpha, groups in [] if args.command_only else SMOOTHING:
        row: dict[str, Any] = {"variant": name, "smooth_alpha": alpha, "smooth_groups": list(groups)}
        for ex, dense_all in EXCLUSIONS:
            t0 = time.perf_counter()
            export = args.out / "exports" / f"{slug(name)}-{ex}"
            opts = NVFP4LayerOptions(smooth_alpha=alpha, smooth_groups=groups, input_scale="max", rounding="nearest")
            run = NVFP4RunOptions(dense_all=dense_all, device=dev, show_progress=False, overwrite=True)
            run_method(MODEL, export, [str(CALIB)], calib, NVFP4Method(opts, run), quiet())
            row[ex] = {"export": str(export), **score(load(export, device=dev, activations="fp4", kernels=False))}
            row[ex]["seconds"] = round(time.perf_counter() - t0, 1)
            _print(console, name, ex, row[ex], row[ex]["seconds"])
        smooth_rows.append(row)
    if args.command_only:
        smooth_pick: dict[str, Any] = {"chosen": SMOOTH_INCUMBENT, "note": "--command-only: not measured here"}
        name, alpha, groups = next(v for v in SMOOTHING if v[0] == SMOOTH_INCUMBENT)
        picked: dict[str, Any] = {"variant": name, "smooth_alpha": alpha, "smooth_groups": list(groups)}
    else:
        smooth_pick = decide(smooth_rows, SMOOTH_INCUMBENT, EXCLUSIONS)
        picked = next(r for r in smooth_rows if r["variant"] == smooth_pick["chosen"])
    console.print(f"smoothing: {smooth_pick}")

    scale_rows: list[dict[str, Any]] = [] if args.command_only else [{"variant": e} for e in ESTIMATORS]
    factors: dict[str, dict[str, float]] = {}
    for ex, _ in [] if args.command_only else EXCLUSIONS:
        net = load(picked[ex]["export"], device=dev, activations="fp4", kernels=False)
        t0 = time.perf_counter()
        stats = input_stats(net, samples, dev)
        console.print(f"input statistics ({ex}): {len(stats)} input groups ({time.perf_counter() - t0:.0f} s)")
        for row in scale_rows:
            t0 = time.perf_counter()
            scales = {k: st.scale(row["variant"]) for k, st in stats.items()}
            factors.setdefault(row["variant"], {})[ex] = mean([float(scales[k] / st.base) for k, st in stats.items()])
            set_scales(net, scales)
            row[ex] = score(net)
            row[ex]["scale_over_max"] = {k: float(scales[k] / st.base) for k, st in stats.items()}
            _print(console, row["variant"], ex, row[ex], time.perf_counter() - t0)
        set_scales(net, {k: st.base for k, st in stats.items()})
    scale_pick = {} if args.command_only else decide(scale_rows, SCALE_INCUMBENT, EXCLUSIONS)
    console.print(f"input scale: {scale_pick}")

    # The command's own mse rule (statistics on its propagation pass, weight-only upstream): the check that the
    # product matches the estimator measured above.
    command_row: dict[str, Any] = {"variant": "nvfp4 --input-scale mse (the command)"}
    for ex, dense_all in EXCLUSIONS:
        t0 = time.perf_counter()
        export = args.out / "exports" / f"input-scale-mse-{ex}"
        opts = NVFP4LayerOptions(
            smooth_alpha=picked["smooth_alpha"],
            smooth_groups=tuple(picked["smooth_groups"]),
            input_scale="mse",
            rounding="nearest",
        )
        run = NVFP4RunOptions(dense_all=dense_all, device=dev, show_progress=False, overwrite=True)
        run_method(MODEL, export, [str(CALIB)], calib, NVFP4Method(opts, run), quiet())
        command_row[ex] = score(load(export, device=dev, activations="fp4", kernels=False))
        report = json.loads((export / "quant_report.json").read_text())
        command_row[ex]["factors"] = {
            f"{r['layer']}.{g}": v["factor"] for r in report["layers"] for g, v in r.get("input_scale", {}).items()
        }
        command_row[ex]["calibrate_s"] = report["timings_s"]["calibrate_and_quantize"]
        _print(console, command_row["variant"], ex, command_row[ex], time.perf_counter() - t0)
    scale_rows.append(command_row)

    result = {
        "model": str(MODEL.relative_to(ROOT)),
        "device": dev,
        "calibration": {"source": str(CALIB.relative_to(ROOT)), "samples": len(samples), "max_len": args.max_len},
        "validation": {**val_info, "windows": len(val.wins)},
        "heldout": {"windows": len(held.wins)},
        "window_tokens": args.window_len,
        "rule": "least mean validation W4A4 KL over both exports; replaces the incumbent only if lower by > 1 pooled "
        "paired SE",
        "smoothing": {"rows": smooth_rows, "decision": smooth_pick},
        "input_scale": {"rows": scale_rows, "decision": scale_pick, "mean_factor_of_max": factors},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "source_state": source_state(WATCHED),
    }
    for part in ("smoothing", "input_scale"):
        for r in result[part]["rows"]:
            for ex, _ in EXCLUSIONS:
                for s in ("validation", "heldout"):
                    r[ex][s] = {k: v for k, v in r[ex][s].items() if not k.startswith("window_")} | {
                        "window_kl": r[ex][s]["window_kl"]
                    }
    (args.out / "nvfp4_w4a4_variants.json").write_text(json.dumps(result, indent=2))
    console.print(table("SmoothQuant for W4A4", smooth_rows))
    console.print(table("input-scale estimator for W4A4 (on the smoothing pick)", scale_rows))
    console.print(f"wall time {result['wall_s']} s; JSON in {args.out / 'nvfp4_w4a4_variants.json'}")


def table(title: str, rows: list[dict[str, Any]]) -> Table:
    t = Table(title=f"{title}: W4A4 validation and held-out figures")
    t.add_column("variant", justify="left")
    for ex, _ in EXCLUSIONS:
        for col in ("val ppl Δ", "val KL", "held ppl Δ", "held KL"):
            t.add_column(f"{ex} {col}", justify="right")
    for r in rows:
        cells = [r["variant"]]
        for ex, _ in EXCLUSIONS:
            v, h = r[ex]["validation"], r[ex]["heldout"]
            cells += [f"{100 * v['ppl_increase']:+.2f}%", f"{v['kl']:.4f}", f"{100 * h['ppl_increase']:+.2f}%"]
            cells.append(f"{h['kl']:.4f}" if math.isfinite(h["kl"]) else "-")
        t.add_row(*cells)
    return t


if __name__ == "__main__":
    main()
