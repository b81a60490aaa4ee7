"""``--budget`` against hand rules of the same size, on the shipped tiny model, scored on a validation text AND on
the held-out windows (the texts, the calibration and the scoring of ``benchmarks/studies/gptq_variants.py``).

Hand rules (GPTQ with the default settings, one bits rule each): every group 4-bit (W4), the minicpm4 layers at
8 bits, all attention at 8 bits (the ``gptq-w4-mlp-w8-attn`` recipe), every down_proj at 8 bits, the lightning
attention at 8 bits, the first and the last lightning layer at 8 bits. Each hand rule's export has a size (its
tensor bytes); ``--budget`` runs at exactly that size, and once more at the size of W4 plus 10%.

The search's one free setting, how many calibration windows of 512 tokens it measures damage on, is chosen on the
validation text by one rule fixed in advance (the least validation KL at the size of the minicpm4 rule, among 4,
8 and 16 windows); the held-out windows only confirm. Rows are cached in ``OUT/rows`` (``--resume``).

  python benchmarks/studies/budget.py --out OUT [--resume] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from scoring import CALIB, MODEL, TextSet, paired, quiet, scoring_arguments, scoring_sets, slug, source_state

from salaquant.budget.size import fixed_bytes, linear_weights
from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions, BitsRule
from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model

LIGHTNING = r"model\.layers\.[1-6]\."  # the shipped model's lightning layers are 1-6
HAND_RULES: list[tuple[str, BitsOptions]] = [
    ("W4 (every group 4-bit)", BitsOptions()),
    ("minicpm4 layers 8-bit", BitsOptions(minicpm4_bits=8)),
    ("attention 8-bit (gptq-w4-mlp-w8-attn)", BitsOptions(rules=(BitsRule(r"\.self_attn\.", bits=8),))),
    ("down_proj 8-bit", BitsOptions(rules=(BitsRule(r"\.mlp\.down_proj$", bits=8),))),
    ("lightning attention 8-bit", BitsOptions(rules=(BitsRule(LIGHTNING + r"self_attn\.", bits=8),))),
    ("first and last lightning layer 8-bit", BitsOptions(layer_bits="1:8,6:8")),
]
W4 = HAND_RULES[0][0]
SELECT_AT = "minicpm4 layers 8-bit"  # the size the search's window count is chosen at
WINDOW_CHOICES = (4, 8, 16)
DEFAULT_WINDOWS = BitsOptions().budget_windows


def tensor_bytes(export: Path) -> int:
    with CheckpointReader(export) as reader:
        return reader.total_bytes()


def run_row(name: str, bits: BitsOptions, args: argparse.Namespace, sets: list[TextSet], console: Console) -> dict:
    export = args.out / "exports" / slug(name)
    cache = args.out / "rows" / f"{slug(name)}.json"
    key = {"bits": json.loads(json.dumps(dataclasses.asdict(bits))), "calibration": [args.max_samples, args.max_len]}
    if args.resume and cache.exists() and (cached := json.loads(cache.read_text())).get("key") == key:
        console.print(f"{name}: from {cache} (--resume)")
        return cached["row"]
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    run = RunOptions(device="cpu", show_progress=False, overwrite=True)
    row: dict[str, Any] = {"variant": name, "budget": bits.budget, "budget_windows": bits.budget_windows}
    t0 = time.perf_counter()
    run_method(MODEL, export, [str(CALIB)], calib, GPTQMethod(bits, GPTQLayerOptions(), run), quiet())
    row["quantize_s"] = round(time.perf_counter() - t0, 1)
    row["bytes"] = tensor_bytes(export)
    report = json.loads((export / "quant_report.json").read_text())
    if "budget" in report:
        b = report["budget"]
        row["search"] = {k: b[k] for k in ("predicted_bytes", "achieved_bytes", "predicted_kl", "measured_kl")}
        row["search"]["seconds"] = b["search_seconds"]
        row["choice"] = {u["unit"]: u["choice"] for u in b["units"]}
    net = load_model(export)
    for s in sets:
        row[s.name] = s.score(net)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "row": row}))
    v, h = row["validation"], row["heldout"]
    console.print(
        f"{name}: {row['bytes']:,} B, validation {100 * v['ppl_increase']:+.2f}% KL {v['kl']:.5f} | "
        f"held-out {100 * h['ppl_increase']:+.2f}% KL {h['kl']:.5f} ({row['seconds']} s)"
    )
    return row


def main() -> None:
    args = scoring_arguments(__doc__).parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 170))
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    state_start = source_state()
    _, sets, val_info = scoring_sets(args)

    rules = dict(HAND_RULES)
    rows = {name: run_row(name, rules[name], args, sets, console) for name in (W4, SELECT_AT)}
    # the search's window count, chosen on the validation text at the size of the minicpm4 rule (first, so that
    # the choice is known early)
    size = rows[SELECT_AT]["bytes"]
    tried = {}
    for n in WINDOW_CHOICES:
        label = f"budget at {SELECT_AT}, {n} windows"
        tried[n] = run_row(label, BitsOptions(budget=str(size), budget_windows=n), args, sets, console)
    picked = min(WINDOW_CHOICES, key=lambda n: tried[n]["validation"]["kl"])
    console.print(f"picked {picked} windows on the validation text")
    rows.update({name: run_row(name, bits, args, sets, console) for name, bits in HAND_RULES if name not in rows})
    rows.update({f"budget at {SELECT_AT}, {n} windows": row for n, row in tried.items()})
    for name, _ in HAND_RULES[2:]:
        label = f"budget at {name}"
        rows[label] = run_row(
            label, BitsOptions(budget=str(rows[name]["bytes"]), budget_windows=picked), args, sets, console
        )
    w4_10 = int(1.1 * rows[W4]["bytes"])
    rows["budget at W4 + 10%"] = run_row(
        "budget at W4 + 10%", BitsOptions(budget=str(w4_10), budget_windows=picked), args, sets, console
    )

    same_size = {f"budget at {name}": name for name, _ in HAND_RULES}  # budget row -> the hand rule of its size
    same_size.update({f"budget at {SELECT_AT}, {n} windows": SELECT_AT for n in WINDOW_CHOICES})
    for label, row in rows.items():
        if label in same_size:
            rule_row = rows[same_size[label]]
            row["vs_hand_rule"] = {
                s: {
                    "kl_reduction": 1 - row[s]["kl"] / rule_row[s]["kl"],
                    **paired(row[s], rule_row[s]),
                }
                for s in ("validation", "heldout")
            }
    table = Table(title="GPTQ under a size budget vs hand rules, shipped tiny model (KL to bf16 per token)")
    for col in (
        "variant",
        "tensor bytes",
        "bits/weight",
        "val ppl +",
        "val KL",
        "held-out ppl +",
        "held-out KL",
        "KL vs hand rule (val / held-out)",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    with CheckpointReader(MODEL) as reader:
        config = SalaConfig.from_dict(reader.config())
        base, weights = fixed_bytes(reader, config), linear_weights(config)
    for label, row in rows.items():
        vs = row.get("vs_hand_rule")
        table.add_row(
            label,
            f"{row['bytes']:,}",
            f"{8 * (row['bytes'] - base) / weights:.3f}",
            f"{100 * row['validation']['ppl_increase']:+.2f}%",
            f"{row['validation']['kl']:.5f}",
            f"{100 * row['heldout']['ppl_increase']:+.2f}%",
            f"{row['heldout']['kl']:.5f}",
            f"{-100 * vs['validation']['kl_reduction']:+.1f}% / {-100 * vs['heldout']['kl_reduction']:+.1f}%"
            if vs
            else "",
        )
    console.print(table)
    result = {
        "rows": rows,
        "picked_windows": picked,
        "default_windows": DEFAULT_WINDOWS,
        "w4_plus_10_bytes": w4_10,
        "validation": val_info,
        "source_start": state_start,
        "source_end": source_state(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (args.out / "budget.json").write_text(json.dumps(result, indent=2))
    console.print(
        f"picked {picked} windows on the validation text (default {DEFAULT_WINDOWS}); {args.out / 'budget.json'}"
    )


if __name__ == "__main__":
    main()
