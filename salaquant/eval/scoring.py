"""How eval scores what it ran: NIAH and task results per length, the measures of repeated sampled runs and
their spread, and the names of outlier layers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from . import niah as nh
from . import tasks as tk
from .options import EvalOptions


def name_outliers(result: dict[str, Any]) -> None:
    layers = result.get("layers")
    if not layers or not layers.get("outliers"):
        return
    by_index = {e["layer"]: e for e in layers["layers"]}
    for i in layers["outliers"]:
        e = by_index[i]
        result["notes"].append(
            f"layer {i} ({e['kind']}) stands out: relative error {e['rel_err']:.4g} vs median "
            f"{layers['median_rel_err']:.4g}; its {e['worst_branch']} branch is off by {e[e['worst_branch']]:.4g} "
            f"(attention {e['attention']:.4g}, mlp {e['mlp']:.4g})"
            + (
                f"; its FP4 activations bring {100 * e['activation_share']:.0f}% of its error"
                if e.get("activation_share") is not None and math.isfinite(e["activation_share"])
                else ""
            )
        )


def run_measures(checks: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one run of the decoding checks, by name."""
    out: dict[str, float] = {}
    if checks.get("niah"):
        out["niah_source_rate"] = checks["niah"]["source_rate"]
        out["niah_quantized_rate"] = checks["niah"]["quantized_rate"]
    for row in (checks.get("tasks") or {}).get("by_task", []):
        out[f"{row['task']}@{row['length']}_source"] = row["source"]
        out[f"{row['task']}@{row['length']}_quantized"] = row["quantized"]
    g = checks.get("generation")
    if g:
        for k in ("collapsed_source", "collapsed_quantized", "loops_source", "loops_quantized", "identical"):
            out[k] = float(g[k])
    return out


def spread(runs: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """min, max, mean and (population) standard deviation of each measure over the runs."""
    out = {}
    for key in runs[0]:
        xs = [r[key] for r in runs]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        out[key] = {"min": min(xs), "max": max(xs), "mean": mean, "std": std}
    return out


def niah_result(built: Sequence[nh.NiahCase], decoded: dict[str, list[dict[str, Any]]], opts: EvalOptions,
                 dense_len: int | None) -> dict[str, Any]:  # fmt: skip
    cases = [case.summary() | {"attention": nh.effective_attention(opts.attention, case.length, dense_len)}
             for case in built]  # fmt: skip
    for name, rows in decoded.items():
        for row, case, d in zip(cases, built, rows, strict=True):
            row[name] = d | {"hit": nh.contains_value(d["text"], case.value)}
    lengths = list(dict.fromkeys(c.length for c in built))
    by_length = []
    for n in lengths:
        rows = [c for c in cases if c["length"] == n]
        by_length.append(
            {
                "length": n,
                "attention": rows[0]["attention"],
                "cases": len(rows),
                "source_hits": sum(c["source"]["hit"] for c in rows),
                "quantized_hits": sum(c["quantized"]["hit"] for c in rows),
            }
        )
    return {
        "lengths": list(lengths),
        "depths": list(opts.niah_depths),
        "cases": cases,
        "by_length": by_length,
        "source_rate": sum(c["source"]["hit"] for c in cases) / len(cases),
        "quantized_rate": sum(c["quantized"]["hit"] for c in cases) / len(cases),
    }


def tasks_result(built: Sequence[tk.TaskCase], decoded: dict[str, list[dict[str, Any]]], opts: EvalOptions,
                  dense_len: int | None) -> dict[str, Any]:  # fmt: skip
    """Each task case scored as ``tasks.score``, and the mean score per task and length of both models."""
    cases = [c.summary() | {"attention": nh.effective_attention(opts.attention, c.length, dense_len)} for c in built]
    for name, rows in decoded.items():
        for row, case, d in zip(cases, built, rows, strict=True):
            row[name] = d | {"score": tk.score(d["text"], case.answers)}
    lengths = list(dict.fromkeys(c.length for c in built))
    by_task = []
    for task in dict.fromkeys(c.task for c in built):
        for n in lengths:
            rows = [c for c in cases if c["task"] == task and c["length"] == n]
            src = sum(c["source"]["score"] for c in rows) / len(rows)
            qnt = sum(c["quantized"]["score"] for c in rows) / len(rows)
            by_task.append({"task": task, "length": n, "attention": rows[0]["attention"], "cases": len(rows),
                            "source": src, "quantized": qnt, "drop": src - qnt})  # fmt: skip
    return {"tasks": list(dict.fromkeys(c.task for c in built)), "lengths": lengths, "samples": opts.task_samples,
            "cases": cases, "by_task": by_task}  # fmt: skip
