"""Gates on an eval result: each threshold given is checked and reported; any miss makes the run fail.

| threshold | fails when |
|---|---|
| ``max_ppl_increase`` | ppl(quantized) / ppl(source) - 1 exceeds it (a fraction: 0.05 or "5%") |
| ``max_kl`` | the mean KL(source || quantized) per token exceeds it (nats) |
| ``min_top1`` | the top-1 agreement of next-token predictions is below it (0.9 or "90%") |
| ``max_layer_error`` | some decoder layer's relative output error exceeds it |
| ``max_niah_drop`` | the quantized model's NIAH exact-match rate is below the source's by more than it |
| ``max_task_drop`` | per task (``{"cwe": 0.05}``): the quantized model's mean score is below the source's by more |
| ``max_rerun_diff`` | two runs of the quantized model on the same window differ by more than it (abs. logit) |
| ``no_collapse`` | the quantized model collapses where the source does not, or gives a NaN/Inf logit anywhere |
| ``no_new_loops`` | a greedy continuation of the quantized model loops where the source's does not |

Collapse: a greedy continuation flooded with the unknown token or holding one token repeated (see
``generation``), or, on the held-out windows, the unknown token as top-1 prediction at >= 25% of positions.

A NaN measurement fails every threshold on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .generation import UNK_FRACTION


def parse_fraction(text: str | float, name: str) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05; plain numbers must lie in [0, 1] (write ``150%`` for more)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected a fraction such as 0.05 or a percentage such as 5%") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {text!r}: must be a non-negative number")
    if not raw.endswith("%") and value > 1:
        raise ValueError(f"{name} {text!r}: a plain number is a fraction in [0, 1]; write {raw}% for a percentage")
    return value


def parse_task_drops(text: str, tasks: tuple[str, ...]) -> dict[str, float]:
    """``"cwe=5%,vt=0.1"`` -> ``{"cwe": 0.05, "vt": 0.1}`` (each task one of ``tasks``)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        task, sep, limit = part.partition("=")
        if not sep or task.strip() not in tasks:
            raise ValueError(f"--max-drop {part!r}: expected TASK=FRACTION with TASK one of {', '.join(tasks)}")
        out[task.strip()] = parse_fraction(limit, f"--max-drop {task.strip()}")
    if not out:
        raise ValueError("--max-drop: no task given")
    return out


def parse_non_negative(text: str | float, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {text!r}: must be a non-negative number")
    return value


@dataclass
class Thresholds:
    max_ppl_increase: float | None = None
    max_kl: float | None = None
    min_top1: float | None = None
    max_layer_error: float | None = None
    max_niah_drop: float | None = None
    max_rerun_diff: float | None = None
    max_task_drop: dict[str, float] | None = None
    no_collapse: bool = False
    no_new_loops: bool = False

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}

    def check(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        """One entry per threshold given: name, limit, measured value, passed, message."""
        out: list[dict[str, Any]] = []
        ppl = result.get("perplexity")

        def add(name: str, limit: Any, value: Any, passed: bool, message: str) -> None:
            out.append({"name": name, "limit": limit, "value": value, "passed": passed, "message": message})

        def missing(name: str, limit: Any, what: str) -> None:
            add(name, limit, None, False, f"{name}: {what} was not measured")

        def bound(
            name: str, value: float | None, what: str, message: Callable[[float, float], str], lower: bool = False
        ) -> None:
            """The gate ``name`` (a limit of this object, None: not given) on ``value`` (None: not measured): an
            upper bound, or with ``lower`` a lower one."""
            limit = getattr(self, name)
            if limit is None:
                return
            if value is None:
                missing(name, limit, what)
            else:
                add(name, limit, value, _le(limit, value) if lower else _le(value, limit), message(value, limit))

        bound(
            "max_ppl_increase",
            ppl and ppl["ppl_increase"],
            "perplexity",
            lambda v, lim: f"ppl increase {_pct(v)} (limit {_pct(lim)})",
        )
        bound("max_kl", ppl and ppl["kl"], "KL", lambda v, lim: f"KL {v:.5f} per token (limit {lim:g})")
        bound(
            "min_top1",
            ppl and ppl["top1"],
            "top-1 agreement",
            lambda v, lim: f"top-1 agreement {_pct(v, sign=False)} (limit {_pct(lim, sign=False)})",
            lower=True,
        )
        worst = (result.get("layers") or {}).get("worst")
        bound(
            "max_layer_error",
            worst and worst["rel_err"],
            "per-layer error",
            lambda v, lim: f"worst layer {worst['name']} ({worst['kind']}) rel. error {v:.4g} (limit {lim:g})",
        )
        niah = result.get("niah")
        niah_drop = niah["source_rate"] - niah["quantized_rate"] if niah and niah.get("cases") else None
        bound(
            "max_niah_drop",
            niah_drop,
            "NIAH",
            lambda v, lim: (
                f"NIAH exact match {_pct(niah['source_rate'], sign=False)} -> "
                f"{_pct(niah['quantized_rate'], sign=False)} (largest drop allowed {_pct(lim)})"
            ),
        )
        for task, limit in (self.max_task_drop or {}).items():
            rows = [r for r in (result.get("tasks") or {}).get("by_task", []) if r["task"] == task]
            if not rows:
                missing(f"max_drop[{task}]", limit, f"task {task}")
                continue
            src = sum(r["source"] * r["cases"] for r in rows) / sum(r["cases"] for r in rows)
            qnt = sum(r["quantized"] * r["cases"] for r in rows) / sum(r["cases"] for r in rows)
            add(
                f"max_drop[{task}]",
                limit,
                src - qnt,
                _le(src - qnt, limit),
                f"{task} score {_pct(src, sign=False)} -> {_pct(qnt, sign=False)} (largest drop allowed {_pct(limit)})",
            )
        stability = result.get("stability")
        bound(
            "max_rerun_diff",
            stability and stability["max_abs_logit_diff"],
            "run-to-run stability",
            lambda v, lim: f"rerun max |logit difference| {v:.4g} (limit {lim:g})",
        )
        if self.no_collapse:
            problems = collapse_problems(result)
            add("no_collapse", True, len(problems), not problems, "; ".join(problems) or "no collapse, no NaN/Inf")
        if self.no_new_loops:
            gen = result.get("generation")
            if not gen or not gen.get("prompts"):
                missing("no_new_loops", True, "generation")
            else:
                new = [i for i, g in enumerate(gen["prompts"]) if g["quantized"]["loop"] and not g["source"]["loop"]]
                msg = f"n-gram loops only in the quantized continuation of prompt(s) {new}" if new else "no new loops"
                add("no_new_loops", True, len(new), not new, msg)
        return out


def collapse_problems(result: dict[str, Any]) -> list[str]:
    """What ``no_collapse`` fails on, in words (empty: nothing)."""
    problems: list[str] = []
    ppl = result.get("perplexity")
    if ppl is not None:
        if ppl["nonfinite_positions_quantized"]:
            problems.append(
                f"NaN/Inf logits at {ppl['nonfinite_positions_quantized']} of {ppl['tokens']} window positions"
            )
        uq, us = ppl.get("unk_top1_fraction_quantized"), ppl.get("unk_top1_fraction_source")
        if uq is not None and us is not None and uq >= UNK_FRACTION > us:
            problems.append(
                f"the unknown token is the top-1 prediction at {_pct(uq, sign=False)} of window positions "
                f"(source {_pct(us, sign=False)})"
            )
    prompts = (result.get("generation") or {}).get("prompts", [])
    collapsed = [i for i, g in enumerate(prompts) if g["quantized"]["collapse"] and not g["source"]["collapse"]]
    if collapsed:
        first = prompts[collapsed[0]]["quantized"]["collapse"]
        problems.append(f"greedy output collapses on prompt(s) {collapsed} (prompt {collapsed[0]}: {first})")
    nonfinite = [i for i, g in enumerate(prompts) if g["quantized"]["nonfinite_step"] is not None]
    if nonfinite:
        problems.append(f"NaN/Inf logits while generating for prompt(s) {nonfinite}")
    for what, key in (("NIAH", "niah"), ("task", "tasks")):
        cases = (result.get(key) or {}).get("cases", [])
        bad = sum(c["quantized"]["nonfinite_step"] is not None for c in cases)
        if bad:
            problems.append(f"NaN/Inf logits in {bad} of {len(cases)} {what} case(s)")
    return problems


def _le(value: Any, limit: Any) -> bool:
    """value <= limit, False when either is NaN or missing."""
    try:
        return bool(value <= limit)
    except TypeError:
        return False


def _pct(x: float, sign: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return str(x)
    return f"{100 * x:+.2f}%" if sign else f"{100 * x:.2f}%"
