"""NVFP4 rounding and block scales, decided on a validation text: to the nearest E2M1 value or GPTQ's column sweep
(block scales before it or during it), and block scales searched below the plain one only or above it too.

Every variant goes through ``salaquant nvfp4`` (default exclusions and ``--dense-all``) with the calibration set
``benchmarks/quality.py`` uses (32 samples of at most 2048 tokens) and is scored on the validation text and the
held-out windows of ``scoring.py`` (the model's held-out documents not in the shipped sample, and exactly
quality.py's windows), twice: W4A4 (the runtime with ``activations="fp4"``, as Blackwell runs the export) and
weight-only (the project's loader, as Hopper's FP4 Marlin runs it). Candidates: ``--rounding nearest``, ``--rounding
gptq`` with the searched block scales fixed before the sweep (``--static-scales``) and with each block's scales
searched as the sweep reaches it (``--sweep-scales``), each searching scales from the plain one down
(``--mse-max-grow 1``); and the last with scales up to 1.5 times the plain one too (``--mse-max-grow 1.5``).

Rule, fixed before any run: the candidate with the least mean per-token W4A4 KL(bf16 || quantized) on the
validation text, averaged over the default and the dense-all exports, replaces the incumbent (``--incumbent``: the
default before the decision) only if lower by more than one pooled paired standard error over the windows of both
exports (``scoring.decide``). The held-out and the weight-only figures only confirm. Decided (docs/nvfp4.md): GPTQ
rounding with scales during the sweep over nearest (incumbent ``nearest``), then grown scales over shrunk only
(incumbent ``gptq, scales during the sweep``, ``--only grown``).

  python benchmarks/studies/nvfp4_gptq.py --out OUT [--device cuda] [--val-windows N] [--incumbent NAME]
      [--only NAME ...]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from scoring import (
    CALIB,
    MODEL,
    ROOT,
    decide,
    quiet,
    scoring_arguments,
    scoring_sets,
    slug,
    source_state,
)

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.model.loading import load_model
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.load import load

EXCLUSIONS = (("default", False), ("dense-all", True))
VARIANTS: dict[str, NVFP4LayerOptions] = {
    "nearest": NVFP4LayerOptions(rounding="nearest", mse_max_grow=1.0),  # the default before GPTQ rounding
    "gptq, scales before the sweep": NVFP4LayerOptions(rounding="gptq", static_scales=True, mse_max_grow=1.0),
    "gptq, scales during the sweep": NVFP4LayerOptions(rounding="gptq", static_scales=False, mse_max_grow=1.0),
    "gptq, scales during the sweep, grown to 1.5x": NVFP4LayerOptions(
        rounding="gptq", static_scales=False, mse_max_grow=1.5
    ),
}
WATCHED = (
    "salaquant/nvfp4/gptq.py",
    "salaquant/nvfp4/layer.py",
    "salaquant/nvfp4/search.py",
    "salaquant/formats/modelopt_nvfp4/numerics.py",
    "salaquant/calibration/engine.py",
    "salaquant/calibration/stats.py",
    "salaquant/runtime/linear.py",
)


def main() -> None:
    ap = scoring_arguments(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", help="run only these candidates (name substrings; the incumbent always runs)")
    ap.add_argument(
        "--incumbent",
        default="gptq, scales during the sweep, grown to 1.5x",
        choices=list(VARIANTS),
        help="the default the rule defends",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    state_start = source_state(WATCHED)
    dev = args.device
    _, sets, val_info = scoring_sets(args, dev)
    val, held = sets
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)

    rows: list[dict[str, Any]] = []
    for name, opts in VARIANTS.items():
        if args.only and name != args.incumbent and not any(k in name for k in args.only):
            continue
        row: dict[str, Any] = {
            "variant": name,
            "rounding": opts.rounding,
            "static_scales": opts.static_scales,
            "mse_max_grow": opts.mse_max_grow,
        }
        for ex, dense_all in EXCLUSIONS:
            export = args.out / "exports" / f"{slug(name)}-{ex}"
            run = NVFP4RunOptions(dense_all=dense_all, device=dev, show_progress=False, overwrite=True)
            t0 = time.perf_counter()
            run_method(MODEL, export, [str(CALIB)], calib, NVFP4Method(opts, run), quiet())
            quantize_s = time.perf_counter() - t0
            w4a4 = load(export, device=dev, activations="fp4", kernels=False)
            row[ex] = {s.name: s.score(w4a4) for s in sets}
            weight_only = load_model(export, device=dev)
            row[ex]["weight_only"] = {s.name: s.score(weight_only) for s in sets}
            row[ex]["quantize_s"] = round(quantize_s, 1)
            v, h, wo = row[ex]["validation"], row[ex]["heldout"], row[ex]["weight_only"]["heldout"]
            console.print(
                f"{name} ({ex}): W4A4 validation KL {v['kl']:.4f}, held-out {100 * h['ppl_increase']:+.2f}% KL "
                f"{h['kl']:.4f}; weight-only held-out {100 * wo['ppl_increase']:+.2f}% KL {wo['kl']:.4f} "
                f"(quantize {quantize_s:.0f} s)"
            )
        rows.append(row)
    decision = decide(rows, args.incumbent, EXCLUSIONS)
    console.print(f"decision: {decision}")
    state_end = source_state(WATCHED)
    for r in rows:
        for ex, _ in EXCLUSIONS:
            for part in (r[ex], r[ex]["weight_only"]):
                for s in ("validation", "heldout"):
                    part[s] = {k: v for k, v in part[s].items() if k != "window_nll_diff"}
    result = {
        "model": str(MODEL.relative_to(ROOT)),
        "device": dev,
        "calibration": {
            "source": str(CALIB.relative_to(ROOT)),
            "max_samples": args.max_samples,
            "max_len": args.max_len,
        },
        "validation": {**val_info, "windows": len(val.wins)},
        "heldout": {"windows": len(held.wins)},
        "window_tokens": args.window_len,
        "rule": f"least mean validation W4A4 KL over both exports; replaces the incumbent ({args.incumbent}) only if "
        "lower by > 1 pooled paired SE",
        "rows": rows,
        "decision": decision,
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "source_state": {"start": state_start, "end": state_end, "changed_during_run": state_start != state_end},
    }
    (args.out / "nvfp4_gptq.json").write_text(json.dumps(result, indent=2))
    console.print(table(rows))
    console.print(f"wall time {result['wall_s']} s; JSON in {args.out / 'nvfp4_gptq.json'}")


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="NVFP4 rounding on sala-tiny: W4A4 and weight-only, validation and held-out")
    for col in ("variant", "exclusions", "val KL W4A4", "held-out ppl W4A4", "held-out KL W4A4", "held-out KL W4A16"):
        t.add_column(col, justify="left" if col in ("variant", "exclusions") else "right")
    for r in rows:
        for ex, _ in EXCLUSIONS:
            v, h, wo = r[ex]["validation"], r[ex]["heldout"], r[ex]["weight_only"]["heldout"]
            t.add_row(
                r["variant"],
                ex,
                f"{v['kl']:.4f} ±{v['kl_se']:.4f}",
                f"{100 * h['ppl_increase']:+.2f}%",
                f"{h['kl']:.4f}",
                f"{wo['kl']:.4f}",
            )
    return t


if __name__ == "__main__":
    main()
