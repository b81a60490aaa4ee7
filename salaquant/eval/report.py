"""What ``salaquant eval`` shows and writes: terminal tables, ``eval.json`` (every number) and ``eval.png``.

Both files are written to a temporary name in the report folder and renamed into place, so a reader never sees
half a file. Non-finite numbers (a model that produced NaN logits) are written as ``null`` in the JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..io.atomic import atomic_write

JSON_NAME = "eval.json"
PNG_NAME = "eval.png"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: dict[str, Any], folder: Path) -> Path:
    path = folder / JSON_NAME
    text = json.dumps(_finite(result), indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


# ------------------------------------------------------------------------------------------------ terminal


def _f(x: Any, fmt: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, fmt)


def _pct(x: Any, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return str(x)
    return f"{100 * x:+.2f}%" if sign else f"{100 * x:.2f}%"


def render(result: dict[str, Any], console: Console) -> None:
    """The tables: perplexity/KL, NIAH, generation, per-layer error, thresholds."""
    q, r, d = result["quantized"], result["reference"], result["data"]
    console.print(
        f"[bold]{q['path']}[/] ({q['format']}, {q.get('activations', 'bf16')} activations, "
        f"{q.get('kv_cache', 'bf16')} KV cache) vs [bold]{r['path']}[/] "
        f"({r['format']}) on {result['device']}",
        highlight=False,
    )
    check = q["check"]
    console.print(f"format check: {check['status']}" + (f" ({check['detail']})" if check.get("detail") else ""))
    ppl = result.get("perplexity")
    if ppl is not None:
        console.print(
            f"data: {d['source']}, {d['tokens']:,} tokens; {ppl['windows']} windows x {d['window_len']} tokens, "
            f"attention {d['attention']} ({d['effective_attention']})",
            highlight=False,
        )
        t = Table(title="Held-out text: quantized vs source")
        for col in ("metric", "source", "quantized", "difference"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        t.add_row(
            "perplexity",
            _f(ppl["ppl_source"], ".3f"),
            _f(ppl["ppl_quantized"], ".3f"),
            _pct(ppl["ppl_increase"], sign=True),
        )
        t.add_row(
            "mean NLL (nats)", _f(ppl["nll_source"]), _f(ppl["nll_quantized"]), _f(ppl["nll_diff"]["mean"], "+.4f")
        )
        nd = ppl["nll_diff"]
        t.add_row(
            "NLL diff p50/p95/p99/max",
            "",
            "",
            f"{_f(nd['p50'], '+.3f')}/{_f(nd['p95'], '+.3f')}/{_f(nd['p99'], '+.3f')}/{_f(nd['max'], '+.3f')}",
        )
        t.add_row("tokens with higher NLL", "", "", _pct(nd["fraction_worse"]))
        t.add_row(
            "KL(src||q) mean/p99/max",
            "",
            "",
            f"{_f(ppl['kl'], '.5f')}/{_f(ppl['kl_p99'], '.4f')}/{_f(ppl['kl_max'], '.3f')}",
        )
        t.add_row("top-1 agreement", "", "", _pct(ppl["top1"]))
        t.add_row(
            "NaN/Inf positions",
            str(ppl["nonfinite_positions_source"]),
            str(ppl["nonfinite_positions_quantized"]),
            "",
        )
        if ppl.get("unk_top1_fraction_source") is not None:
            t.add_row(
                "unk token as top-1",
                _pct(ppl["unk_top1_fraction_source"]),
                _pct(ppl["unk_top1_fraction_quantized"]),
                "",
            )
        st = result.get("stability")
        if st is not None:
            t.add_row(
                "rerun |Δlogit| / Δtop-1",
                "",
                f"{_f(st['max_abs_logit_diff'], '.3g')} / {st['top1_changes']}",
                "",
            )
        console.print(t)

    niah = result.get("niah")
    if niah and niah.get("cases"):
        t = Table(title=f"Needle in a haystack ({len(niah['depths'])} depths)")
        for col in ("length", "attention", "source", "quantized"):
            t.add_column(col, justify="right")
        for row in niah["by_length"]:
            t.add_row(
                str(row["length"]),
                row["attention"],
                f"{row['source_hits']}/{row['cases']}",
                f"{row['quantized_hits']}/{row['cases']}",
            )
        t.add_row("all", "", _pct(niah["source_rate"]), _pct(niah["quantized_rate"]))
        console.print(t)

    tasks = result.get("tasks")
    if tasks and tasks.get("by_task"):
        t = Table(title=f"Long-context tasks (mean score of {tasks['samples']} case(s) each)")
        for col in ("task", "length", "attention", "source", "quantized", "drop"):
            t.add_column(col, justify="left" if col == "task" else "right")
        for row in tasks["by_task"]:
            t.add_row(row["task"], str(row["length"]), row["attention"], _pct(row["source"]), _pct(row["quantized"]),
                      _pct(row["drop"], sign=True))  # fmt: skip
        console.print(t)

    reps = result.get("repeats")
    if reps and reps.get("spread"):
        t = Table(title=f"{len(reps['runs'])} runs sampled at temperature {reps['temperature']:g}: spread per measure")
        for col in ("measure", "min", "max", "mean", "std"):
            t.add_column(col, justify="left" if col == "measure" else "right")
        for name, sp in reps["spread"].items():
            t.add_row(name, *(f"{sp[k]:.4g}" for k in ("min", "max", "mean", "std")))
        console.print(t)

    gen = result.get("generation")
    if gen and gen.get("prompts"):
        t = Table(title=f"Greedy generation ({gen['max_new_tokens']} tokens)")
        for col in ("#", "prompt", "source", "quantized", "diverges at"):
            t.add_column(col)
        for i, g in enumerate(gen["prompts"]):
            t.add_row(
                str(i),
                _short(g["prompt"], 28),
                _flags(g["source"]),
                _flags(g["quantized"]),
                "-" if g["first_divergence"] is None else str(g["first_divergence"]),
            )
        console.print(t)

    layers = result.get("layers")
    if layers and layers.get("layers"):
        t = Table(title="Per-layer relative error (quantized vs float layer, same input)")
        split = any(e.get("activation_share") is not None for e in layers["layers"])
        cols = ("layer", "kind", "output", "vs branch", "attention", "mlp")
        cols += ("weights only", "FP4 acts only", "acts share") if split else ()
        for col in (*cols, ""):
            t.add_column(col, justify="left" if col in ("layer", "kind", "") else "right")
        outl = set(layers["outliers"])
        worst = layers["worst"]
        for e in layers["layers"]:
            if e["layer"] in outl:
                mark = "[bold red]outlier[/]"
            else:
                mark = "worst" if e["layer"] == worst["layer"] and _order(worst["rel_err"]) > 0 else ""
            t.add_row(
                str(e["layer"]),
                e["kind"],
                _f(e["rel_err"], ".4g"),
                _f(e["rel_err_branch"], ".4g"),
                _f(e["attention"], ".4g"),
                _f(e["mlp"], ".4g"),
                *(_split_cells(e) if split else ()),
                mark,
            )
        console.print(t)

    for line in result.get("notes", []):
        console.print(f"[yellow]note:[/] {line}", highlight=False)
    checks = result.get("thresholds", [])
    for c in checks:
        tag = "[green]PASS[/]" if c["passed"] else "[bold red]FAIL[/]"
        console.print(f"{tag} {c['name']}: {c['message']}", highlight=False)
    if checks:
        console.print("[green]all thresholds met[/]" if result["passed"] else "[bold red]thresholds missed[/]")


def _split_cells(e: dict[str, Any]) -> tuple[str, str, str]:
    if e.get("activation_share") is None:
        return ("-", "-", "-")
    return (_f(e["weights_only"], ".4g"), _f(e["activations_only"], ".4g"), _pct(e["activation_share"]))


def _order(x: Any) -> float:
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _short(text: str, n: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 1] + "…"


def _flags(g: dict[str, Any]) -> str:
    flags = []
    if g["collapse"]:
        flags.append("[bold red]collapse[/]")
    if g["loop"]:
        flags.append(f"loop (period {g['loop']['period']})")
    if g["nonfinite_step"] is not None:
        flags.append("[bold red]NaN/Inf[/]")
    return ", ".join(flags) or "ok"


# ------------------------------------------------------------------------------------------------ figure


def write_png(result: dict[str, Any], folder: Path) -> Path:
    """Per-layer error bars, perplexity / KL / top-1, the per-token NLL-difference histogram, NIAH rates and a panel
    per long-context task (score against length, source and quantized)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result.get("tasks") or {}
    names = tasks.get("tasks") or []
    rows = 2 + -(-len(names) // 2)  # a panel per task below the four
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    ax = axes[0][0]
    layers = (result.get("layers") or {}).get("layers") or []
    if layers:
        colors = {"minicpm4": "tab:orange", "lightning": "tab:blue"}
        xs = [e["layer"] for e in layers]
        ys = [_plot_value(e["rel_err"]) for e in layers]
        outl = set(result["layers"]["outliers"])
        ax.bar(
            xs,
            ys,
            color=[colors.get(e["kind"], "tab:gray") for e in layers],
            edgecolor=["red" if e["layer"] in outl else "none" for e in layers],
            linewidth=2,
        )
        parts = [("attention", "attention", "^", "black"), ("mlp", "mlp", "v", "black")]
        if any(e.get("activation_share") is not None for e in layers):
            parts += [("weights_only", "weights only", "x", "tab:green")]
            parts += [("activations_only", "FP4 activations only", "o", "tab:red")]
        for part, label, marker, color in parts:
            ys_part = [_plot_value(e.get(part)) for e in layers]
            ax.scatter(xs, ys_part, marker=marker, color=color, s=18, label=label)
        log = all(y > 0 for y in ys + [_plot_value(e[k]) for e in layers for k in ("attention", "mlp")])
        if log:
            ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * (6 if log else 1.25))  # room for the legend above the markers
        ax.legend(title="branch / quantized part alone", fontsize=8, loc="upper center", ncol=2)
        ax.set_xticks(xs)
        ax.set_xlabel("decoder layer (orange: minicpm4, blue: lightning; red edge: outlier)")
        ax.set_ylabel("relative error: bars ||y_q - y_f|| / ||y_f||")
        worst = result["layers"]["worst"]
        ax.set_title(f"Per-layer relative error (worst: layer {worst['layer']})")
    else:
        _empty(ax, "per-layer error not measured")

    ax = axes[0][1]
    ppl = result.get("perplexity")
    if ppl is not None:
        vals = [_plot_value(ppl["ppl_source"]), _plot_value(ppl["ppl_quantized"])]
        bars = ax.bar(["source", "quantized"], vals, color=["tab:gray", "tab:green"])
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.3f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
        ax.set_ylabel("perplexity")
        ax.set_title(
            f"ppl {_pct(ppl['ppl_increase'], sign=True)}, KL {_f(ppl['kl'], '.4f')}, top-1 {_pct(ppl['top1'])}"
        )
    else:
        _empty(ax, "perplexity not measured")

    ax = axes[1][0]
    if ppl is not None:
        h = ppl["nll_diff"]["histogram"]
        edges, counts = h["edges"], h["counts"]
        ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", color="tab:purple")
        if any(counts):
            ax.set_yscale("log")
        ax.set_xlabel("NLL(quantized) - NLL(source) per token, nats (clipped to the range)")
        ax.set_ylabel("tokens")
        ax.set_title(f"per-token NLL difference (mean {_f(ppl['nll_diff']['mean'], '+.4f')})")
    else:
        _empty(ax, "")

    ax = axes[1][1]
    niah = result.get("niah")
    if niah and niah.get("cases"):
        rows = niah["by_length"]
        xs = list(range(len(rows)))
        ax.bar([x - 0.2 for x in xs], [r["source_hits"] / r["cases"] for r in rows], 0.4, label="source")
        ax.bar([x + 0.2 for x in xs], [r["quantized_hits"] / r["cases"] for r in rows], 0.4, label="quantized")
        for x, r in zip(xs, rows, strict=True):
            label = f"{r['source_hits']}/{r['cases']} vs {r['quantized_hits']}/{r['cases']}"
            ax.annotate(label, (x, max(r["source_hits"], r["quantized_hits"]) / r["cases"]), ha="center", va="bottom")
        ax.set_xticks(xs, [f"{r['length']}\n{r['attention']}" for r in rows])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("exact match")
        ax.legend()
        ax.set_title("needle in a haystack")
    else:
        _empty(ax, "NIAH not run")
    for i, task in enumerate(names):
        ax = axes[2 + i // 2][i % 2]
        points = [r for r in tasks["by_task"] if r["task"] == task]
        xs = list(range(len(points)))
        for key, style in (("source", "o-"), ("quantized", "s--")):
            ax.plot(xs, [_plot_value(r[key]) for r in points], style, label=key)
        ax.set_xticks(xs, [f"{r['length']}\n{r['attention']}" for r in points])
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(f"mean score ({tasks['samples']} case(s) per length)")
        ax.set_title(task)
        ax.legend()
    if len(names) % 2:
        axes[-1][1].set_axis_off()
    fig.suptitle(f"{result['quantized']['path']} ({result['quantized']['format']}) vs {result['reference']['path']}")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # half an inch for the title
    path = folder / PNG_NAME
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return path


def _plot_value(x: Any) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
