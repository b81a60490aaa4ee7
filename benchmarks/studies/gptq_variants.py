"""GPTQ W4A16 option variants on the shipped tiny model, scored on a validation text AND on the held-out windows.

``benchmarks/quality.py`` scores every quantizer on one text, the shipped held-out sample. Choosing GPTQ
defaults by that figure alone would tune them to that text (and to its noise). Here every variant is scored
on two disjoint texts, neither of which is used for calibration:

* **validation**: the documents of ``models/sala-tiny/heldout.jsonl`` (the model's held-out split, never used
  for training or calibration) that are *not* in the shipped held-out sample (records 10-33, ~118K tokens);
  settings are chosen on this text only;
* **held-out**: exactly the windows ``quality.py`` scores (the first 16 x 1024 tokens of
  ``salaquant/eval/heldout_sample.jsonl``), used only to confirm the choice.

Calibration is the one ``quality.py`` uses (the shipped ``calib/sala-tiny-calib.jsonl``, 32 samples x 2048
tokens), the export goes through ``salaquant gptq`` (calibration engine, GPTQ v1 export, checker) and is read
back by ``salaquant.model.loading.load_model``. Figures per text: perplexity increase over bf16, mean per-token
KL(bf16 || quantized), top-1 agreement (the figures of ``salaquant.eval.metrics.LogitComparison``), with a
standard error over windows, and a paired comparison against the current default on the same windows (the
noise shared by two variants on the same text cancels there).

Selection uses the validation text only, by one rule fixed before any run: the least mean per-token KL.

1. ``auto alpha``: the SmoothQuant alpha (``None``, no smoothing, included) of the MSE-scale sweep with the least
   validation KL;
2. each single-option change (act_order, damp 0.05, per-token Hessian) is tried again on top of the auto alpha
   (stage 2), and the ``validation pick`` is the auto alpha plus every change that lowers validation KL by more
   than one paired standard error (run as one more variant when it combines two or more changes).

The held-out figures of the pick are then a confirmation, not a fit. The mean relative output error of the
linears on the calibration inputs (the GPTQ objective, from ``quant_report.json``) is a third, text-free signal.

  python benchmarks/studies/gptq_variants.py --out OUT [--only NAME ...] [--val-windows N] [--no-stage2] [--resume]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from scoring import (
    CALIB,
    MODEL,
    ROOT,
    TextSet,
    mean,
    paired,
    quiet,
    scoring_arguments,
    scoring_sets,
    slug,
    source_state,
)

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.loading import load_model

MSE = GPTQLayerOptions(mse=True, smooth_alpha=0.5)
ALPHA_GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)

# (name, options, sweep tag): the alpha sweep (tag "alpha") is what "auto alpha" picks from; the single-option
# changes (tag "single") are tried again on top of the auto alpha in stage 2.
VARIANTS: list[tuple[str, GPTQLayerOptions, str]] = [
    ("RTN W4 g128 (baseline)", GPTQLayerOptions(method="rtn", mse=False, smooth_alpha=None), ""),
    ("GPTQ plain scales, alpha 0.5", GPTQLayerOptions(mse=False, smooth_alpha=0.5), ""),
    ("GPTQ plain scales, no smoothing", GPTQLayerOptions(mse=False, smooth_alpha=None), ""),
    ("GPTQ no smoothing, mse", dataclasses.replace(MSE, smooth_alpha=None), "alpha"),
    *((f"GPTQ mse, alpha {a}", dataclasses.replace(MSE, smooth_alpha=a), "alpha") for a in ALPHA_GRID),
    ("GPTQ mse, alpha 0.5, act_order", dataclasses.replace(MSE, act_order=True), "single"),
    ("GPTQ mse, alpha 0.5, damp 0.05", dataclasses.replace(MSE, damp=0.05), "single"),
    ("GPTQ mse, alpha 0.5, tokens Hessian", dataclasses.replace(MSE, hessian_weighting="tokens"), "single"),
]
DEFAULT = "GPTQ plain scales, alpha 0.5"  # the paired comparisons' reference (the former default)
RTN = "RTN W4 g128 (baseline)"
SINGLE_CHANGES: dict[str, dict[str, Any]] = {
    "act_order": {"act_order": True},
    "damp 0.05": {"damp": 0.05},
    "tokens Hessian": {"hessian_weighting": "tokens"},
}


def calib_rel_err(export: Path) -> float | None:
    """Mean over linears of the relative output error on the calibration inputs (``quant_report.json``)."""
    report = export / "quant_report.json"
    if not report.exists():
        return None
    summary = json.loads(report.read_text()).get("summary") or {}
    vals = [v["gptq"] for v in summary.values()]
    return mean(vals) if vals else None


def run_variant(
    name: str, opts: GPTQLayerOptions, tag: str, args: argparse.Namespace, sets: list[TextSet], console: Console
) -> dict[str, Any]:
    export = args.out / "exports" / slug(name)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    run = RunOptions(device="cpu", show_progress=False, overwrite=True)
    row: dict[str, Any] = {"variant": name, "tag": tag, "options": dataclasses.asdict(opts)}
    key = json.loads(
        json.dumps(
            {
                "options": row["options"],
                "calibration": [args.max_samples, args.max_len],
                "windows": {s.name: [len(s.wins), int(s.wins[0].numel())] for s in sets},
            }
        )
    )
    cache = args.out / "rows" / f"{slug(name)}.json"
    if args.resume and cache.exists() and (cached := json.loads(cache.read_text())).get("key") == key:
        console.print(f"{name}: from {cache} (--resume)")
        return {**cached["row"], "variant": name, "tag": tag, "from_cache": str(cache)}
    t0 = time.perf_counter()
    try:
        run_method(MODEL, export, [str(CALIB)], calib, GPTQMethod(BitsOptions(), opts, run), quiet())
        row["quantize_s"] = round(time.perf_counter() - t0, 1)
        row["calib_rel_err"] = calib_rel_err(export)
        net = load_model(export)
        for s in sets:
            row[s.name] = s.score(net)
    except Exception as exc:  # a failing variant is a result
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["source_sha256_16"] = source_state()["sha256_16"]  # the files as they are when the variant finishes
    if "error" not in row:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "row": row}))
    if "error" in row:
        console.print(f"{name}: failed: {row['error']} ({row['seconds']} s)")
    else:
        v, h = row["validation"], row["heldout"]
        console.print(
            f"{name}: validation {100 * v['ppl_increase']:+.2f}% KL {v['kl']:.4f} | "
            f"held-out {100 * h['ppl_increase']:+.2f}% KL {h['kl']:.4f} ({row['seconds']} s)"
        )
    return row


def best(rows: list[dict[str, Any]], candidates: list[str]) -> dict[str, Any] | None:
    """The candidate with the least validation KL (the selection rule, fixed before any run)."""
    ok = [r for r in rows if r["variant"] in candidates and "validation" in r]
    return min(ok, key=lambda r: r["validation"]["kl"]) if ok else None


def _alpha_label(alpha: float | None) -> str:
    return "no smoothing" if alpha is None else f"alpha {alpha}"


def stage2_variants(auto: dict[str, Any]) -> list[tuple[str, GPTQLayerOptions, str]]:
    """Each single-option change on top of the auto-alpha row's options (none when that row is alpha 0.5 with
    mse, whose single changes stage 1 already ran)."""
    base = GPTQLayerOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in auto["options"].items()})
    if base == MSE:
        return []
    label = _alpha_label(base.smooth_alpha)
    return [
        (f"GPTQ mse, {label}, {name}", dataclasses.replace(base, **change), "single@auto")
        for name, change in SINGLE_CHANGES.items()
    ]


def validation_pick(
    rows: list[dict[str, Any]], auto: dict[str, Any]
) -> tuple[dict[str, Any] | GPTQLayerOptions, list[str]]:
    """The auto-alpha row plus every single change on top of it that lowered validation KL by more than one paired
    standard error: that row itself when there is no such change or one, else the options combining them."""
    base = MSE if auto["options"] == dataclasses.asdict(MSE) else None
    singles = [r for r in rows if r["tag"] == ("single" if base is not None else "single@auto") and "validation" in r]
    why = [f"smooth_alpha={auto['options']['smooth_alpha']} (auto alpha: least validation KL of the sweep)"]
    winners = []
    for r in singles:
        d = paired(r["validation"], auto["validation"])
        diff = {k: v for k, v in r["options"].items() if v != auto["options"][k]}
        verdict = "kept" if d["kl"] < -d["kl_se"] else "not kept"
        why.append(f"{diff}: validation KL {d['kl']:+.5f} ±{d['kl_se']:.5f} vs auto alpha, {verdict}")
        if d["kl"] < -d["kl_se"]:
            winners.append((r, diff))
    if not winners:
        return auto, why
    if len(winners) == 1:
        return winners[0][0], why
    changes: dict[str, Any] = {}
    for _, diff in winners:
        changes.update(diff)
    opts = GPTQLayerOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in auto["options"].items()})
    return dataclasses.replace(opts, **changes), why


def main() -> None:
    ap = scoring_arguments(__doc__)
    ap.add_argument("--only", nargs="*", help="run only variants whose name contains one of these strings")
    ap.add_argument("--no-stage2", action="store_true", help="skip stage 2 (single changes on the auto alpha)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 170))  # the tables are wide; logs are not terminals
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    state_start = source_state()

    reference, sets, val_info = scoring_sets(args)
    val, held = sets
    bf16 = {s.name: s.score(reference) for s in sets}
    console.print(
        f"bf16: validation ppl {bf16['validation']['ppl']:.3f} ({len(val.wins)} windows), "
        f"held-out ppl {bf16['heldout']['ppl']:.3f} ({len(held.wins)} windows)"
    )

    variants = [v for v in VARIANTS if not args.only or any(s in v[0] for s in args.only)]
    rows = [run_variant(name, opts, tag, args, sets, console) for name, opts, tag in variants]

    alpha_rows = [r["variant"] for r in rows if r["tag"] == "alpha"]
    auto = best(rows, alpha_rows)
    picks: dict[str, Any] = {}
    if auto is not None:
        picks["auto_alpha"] = {"variant": auto["variant"], "smooth_alpha": auto["options"]["smooth_alpha"]}
        if not args.no_stage2:
            rows += [run_variant(name, opts, tag, args, sets, console) for name, opts, tag in stage2_variants(auto)]
            pick, why = validation_pick(rows, auto)
            if isinstance(pick, GPTQLayerOptions):
                rows.append(run_variant("GPTQ validation pick (combined)", pick, "pick", args, sets, console))
                pick = rows[-1]
            picks["validation_pick"] = {"variant": pick["variant"], "options": pick["options"], "why": why}
    overall = best(rows, [r["variant"] for r in rows if r["variant"] != RTN])
    if overall is not None:
        picks["least_validation_kl_any_row"] = overall["variant"]

    by_name = {r["variant"]: r for r in rows if "validation" in r}
    for r in rows:
        if "validation" not in r:
            continue
        refs = [(DEFAULT, "vs_default"), (RTN, "vs_rtn")]
        if "validation_pick" in picks:
            refs.append((picks["validation_pick"]["variant"], "vs_pick"))
        for ref_name, key in refs:
            if ref_name in by_name and ref_name != r["variant"]:
                r[key] = {s.name: paired(r[s.name], by_name[ref_name][s.name]) for s in sets}
        if RTN in by_name:
            r["target"] = {
                s.name: r[s.name]["ppl_increase"] <= 0.5 * by_name[RTN][s.name]["ppl_increase"] for s in sets
            }

    state_end = source_state()
    result = {
        "model": str(MODEL.relative_to(ROOT)),
        "calibration": {
            "source": str(CALIB.relative_to(ROOT)),
            "max_samples": args.max_samples,
            "max_len": args.max_len,
        },
        "heldout": {"source": "salaquant/eval/heldout_sample.jsonl", "windows": len(held.wins)},
        "validation": {**val_info, "windows": len(val.wins)},
        "window_tokens": args.window_len,
        "attention": "dense",
        "device": "cpu",
        "selection_rule": "least mean per-token KL(bf16 || quantized) on the validation text",
        "bf16": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("window_")} for k, v in bf16.items()},
        "rows": rows,
        "picks": picks,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "threads": args.threads,
        "source_state": {"start": state_start, "end": state_end, "changed_during_run": state_start != state_end},
    }
    (args.out / "gptq_variants.json").write_text(json.dumps(result, indent=2))
    console.print(table(result))
    console.print(paired_table(result, "vs_default", "the current default"))
    if "validation_pick" in picks:
        console.print(paired_table(result, "vs_pick", f"the validation pick ({picks['validation_pick']['variant']})"))
    for k, v in picks.items():
        console.print(f"{k}: {v}")
    if result["source_state"]["changed_during_run"]:
        console.print("[yellow]warning: watched salaquant sources changed during the run (see source_state)[/]")
    console.print(f"wall time {result['wall_s']} s; JSON in {args.out / 'gptq_variants.json'}")


def _pct(r: dict[str, Any]) -> str:
    return f"{100 * r['ppl_increase']:+.2f}% ±{100 * r['ppl_increase_se']:.2f}"


def table(result: dict[str, Any]) -> Table:
    v, h = result["validation"], result["heldout"]
    t = Table(
        title=f"{result['model']} W4A16: validation ({v['windows']} x {result['window_tokens']} tokens, not the "
        f"held-out text) and held-out ({h['windows']} x {result['window_tokens']}, quality.py's); ± 1 SE over windows"
    )
    cols = (
        "variant",
        "val ppl Δ",
        "val KL",
        "val top-1",
        "held ppl Δ",
        "held KL",
        "held top-1",
        "≤½ RTN",
        "calib err",
        "s",
    )
    for col in cols:
        t.add_column(col, justify="left" if col == "variant" else "right")
    for r in result["rows"]:
        if "validation" not in r:
            t.add_row(r["variant"], *["-"] * 8, f"failed: {r.get('error', '')[:60]}")
            continue
        va, he = r["validation"], r["heldout"]
        target = r.get("target", {})
        t.add_row(
            r["variant"],
            _pct(va),
            f"{va['kl']:.4f}",
            f"{100 * va['top1']:.2f}%",
            _pct(he),
            f"{he['kl']:.4f}",
            f"{100 * he['top1']:.2f}%",
            "/".join("yes" if target.get(k) else "no" for k in ("validation", "heldout")) if target else "-",
            f"{r['calib_rel_err']:.3e}" if r.get("calib_rel_err") is not None else "-",
            f"{r['seconds']:.0f}",
        )
    return t


def paired_table(result: dict[str, Any], key: str, against: str) -> Table:
    t = Table(title=f"Paired against {against} on the same windows (negative: better than {against}); ± 1 SE")
    for col in ("variant", "val ΔNLL (nats/tok)", "val ΔKL", "val KL better", "held ΔNLL", "held ΔKL", "held better"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for r in result["rows"]:
        d = r.get(key)
        if not d:
            continue
        va, he = d["validation"], d["heldout"]
        t.add_row(
            r["variant"],
            f"{va['nll']:+.5f} ±{va['nll_se']:.5f}",
            f"{va['kl']:+.5f} ±{va['kl_se']:.5f}",
            f"{100 * va['kl_windows_better']:.0f}%",
            f"{he['nll']:+.5f} ±{he['nll_se']:.5f}",
            f"{he['kl']:+.5f} ±{he['kl_se']:.5f}",
            f"{100 * he['kl_windows_better']:.0f}%",
        )
    return t


if __name__ == "__main__":
    main()
