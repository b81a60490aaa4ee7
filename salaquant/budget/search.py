"""A budget spent: the units' sizes checked against it, their damage measured (``measure``), the least-damage
choice solved (``solver``), and the report of what was chosen, predicted and (after the export) achieved."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ..calibration.distributed import SINGLE, Ranks, broadcast_object
from ..io.atomic import atomic_json
from ..io.reader import CheckpointReader
from ..model.config import SalaConfig
from ..progress import Phases
from .measure import Perturb, export_kl, measure_costs, search_windows
from .size import Budget, BudgetError, Unit, describe_bytes, fixed_bytes, linear_weights
from .solver import solve


@dataclass(frozen=True)
class SearchOptions:
    """The calibration windows the damage is measured on: ``windows`` of ``seq_len`` tokens."""

    windows: int
    seq_len: int


@dataclass
class BudgetPlan:
    """What the search chose: ``choice[u]`` is the option index of ``units[u]``."""

    budget: Budget
    target: int  # tensor bytes
    base: int  # tensor bytes outside every decoder linear
    weights: int  # decoder-linear weights
    units: list[Unit]
    costs: list[list[float]]
    choice: list[int]
    windows: int  # windows measured on (fewer than requested when the calibration holds fewer)
    seq_len: int
    seconds: float
    requested: SearchOptions
    parts: dict[str, float] = field(default_factory=dict)  # seconds of the measurement by part (rank 0's)
    achieved: dict[str, Any] = field(default_factory=dict)

    def option(self, unit: int) -> str:
        return self.units[unit].options[self.choice[unit]]

    @property
    def predicted_bytes(self) -> int:
        return self.base + sum(u.sizes[k] for u, k in zip(self.units, self.choice, strict=True))

    @property
    def predicted_kl(self) -> float:
        return sum(c[k] for c, k in zip(self.costs, self.choice, strict=True))

    def report(self) -> dict[str, Any]:
        return {
            "budget": self.budget.text,
            "budget_bytes": self.target,
            "predicted_bytes": self.predicted_bytes,
            "predicted_bits": 8 * (self.predicted_bytes - self.base) / self.weights,
            "predicted_kl": self.predicted_kl,
            "base_bytes": self.base,
            "linear_weights": self.weights,
            "windows": self.windows,
            "seq_len": self.seq_len,
            "requested_windows": self.requested.windows,
            "search_seconds": round(self.seconds, 2),
            "search_parts_s": {k: round(v, 2) for k, v in self.parts.items()},
            **self.achieved,
            "units": [
                {
                    "unit": unit.full_name,
                    "members": list(unit.members),
                    "choice": unit.options[k],
                    "options": {
                        o: {"bytes": s, "kl": c} for o, s, c in zip(unit.options, unit.sizes, cost, strict=True)
                    },
                }
                for unit, cost, k in zip(self.units, self.costs, self.choice, strict=True)
            ],
        }


def budget_range(
    reader: CheckpointReader, config: SalaConfig, units: Sequence[Unit], budget: Budget
) -> tuple[int, int]:
    """``(target, base)``: the budget in tensor bytes and the bytes outside every decoder linear; BudgetError when
    the smallest choice does not fit the budget or the largest one does (nothing would be quantized)."""
    base = fixed_bytes(reader, config)
    weights = linear_weights(config)
    fixed = base + sum(u.sizes[0] for u in units if len(u.options) == 1)
    target = budget.target(base, weights)
    choosable = [u for u in units if len(u.options) > 1]
    smallest = fixed + sum(min(u.sizes) for u in choosable)
    largest = fixed + sum(max(u.sizes) for u in choosable)
    if target < smallest:
        raise BudgetError(
            f"budget {budget.text} ({describe_bytes(target, weights, base)}) is below the smallest export these "
            f"settings allow, {describe_bytes(smallest, weights, base)} with every group at its smallest option"
        )
    if target >= largest:
        raise BudgetError(
            f"budget {budget.text} ({describe_bytes(target, weights, base)}) holds every group unquantized "
            f"({describe_bytes(largest, weights, base)}): nothing to quantize"
        )
    return target, base


@dataclass(frozen=True)
class BudgetSearch:
    """What a search reads: the checkpoint, the calibration samples, the units and how an option perturbs a
    layer (``perturb``), the budget and the windows measured on; ``ranks`` share one search's result."""

    reader: CheckpointReader
    config: SalaConfig
    samples: Sequence[torch.Tensor]
    units: list[Unit]
    perturb: Perturb
    budget: Budget
    options: SearchOptions
    device: torch.device
    console: Console
    ranks: Ranks = SINGLE


def choose(search: BudgetSearch) -> BudgetPlan:
    """Measure every option's damage (on rank 0; the costs go to every process), then solve the choice."""
    config, units, budget, options, console = search.config, search.units, search.budget, search.options, search.console
    target, base = budget_range(search.reader, config, units, budget)
    fixed = base + sum(u.sizes[0] for u in units if len(u.options) == 1)
    ids = search_windows(search.samples, options.windows, options.seq_len)
    t0 = time.perf_counter()
    console.print(
        f"budget {budget.text}: measuring {sum(len(u.options) - 1 for u in units)} options of "
        f"{sum(len(u.options) > 1 for u in units)} groups on {ids.shape[0]} x {ids.shape[1]} calibration tokens"
    )

    parts: dict[str, float] = {}
    costs = None
    if search.ranks.main:
        what = "budget search: layers (then the KL of every option)"
        with Phases(not console.quiet) as progress, progress.phase(what, config.num_hidden_layers) as step:
            costs = measure_costs(search.reader, config, ids, units, search.perturb, search.device, step, parts)
    costs = broadcast_object(costs, search.ranks)
    assert costs is not None
    choosable = [u for u, unit in enumerate(units) if len(unit.options) > 1]
    picked = solve([units[u].sizes for u in choosable], [costs[u] for u in choosable], target - fixed)
    if picked is None:  # budget_range has ruled this out
        raise BudgetError(f"budget {budget.text}: no choice fits")
    choice = [0] * len(units)
    for u, k in zip(choosable, picked, strict=True):
        choice[u] = k
    plan = BudgetPlan(
        budget, target, base, linear_weights(config), units, costs, choice, ids.shape[0], ids.shape[1],
        time.perf_counter() - t0, options, parts,
    )  # fmt: skip
    console.print(
        f"budget {budget.text}: chose {describe_bytes(plan.predicted_bytes, plan.weights, base)} of "
        f"{describe_bytes(target, plan.weights, base)}, predicted KL {plan.predicted_kl:.4g} ({plan.seconds:.1f} s)"
    )
    return plan


def saved_choice(path: Path, budget: Budget, units: Sequence[Unit], options: SearchOptions) -> BudgetPlan | None:
    """The search an earlier run of the same settings saved at ``path`` (``budget.json`` of its work folder), so a
    resumed run quantizes its remaining layers under the same choice; None when there is none or it differs."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = (
        saved.get("budget") == budget.text
        and saved.get("requested_windows") == options.windows
        and saved.get("seq_len") == options.seq_len
        and [(u["unit"], list(u["options"])) for u in saved.get("units", [])]
        == [(u.full_name, list(u.options)) for u in units]
    )
    if not same:
        return None
    entries = saved["units"]
    return BudgetPlan(
        budget=budget,
        target=saved["budget_bytes"],
        base=saved["base_bytes"],
        weights=saved["linear_weights"],
        units=list(units),
        costs=[[e["options"][o]["kl"] for o in u.options] for e, u in zip(entries, units, strict=True)],
        choice=[u.options.index(e["choice"]) for e, u in zip(entries, units, strict=True)],
        windows=saved["windows"],
        seq_len=saved["seq_len"],
        seconds=saved["search_seconds"],
        requested=options,
        parts=saved.get("search_parts_s", {}),
    )


def budget_achieved(
    plan: BudgetPlan,
    source: Path,
    export: Path,
    samples: Sequence[torch.Tensor],
    device: torch.device,
    on_layer: Callable[..., None] | None = None,
) -> None:
    """The export's tensor bytes and its KL to the source on the search windows, into ``plan.achieved``
    (``on_layer`` is told after each layer of the two models)."""
    t0 = time.perf_counter()
    with CheckpointReader(export) as reader:
        achieved = reader.total_bytes()
    ids = search_windows(samples, plan.windows, plan.seq_len)
    kl = export_kl(source, export, ids, device)
    seconds = round(time.perf_counter() - t0, 2)
    plan.achieved = {"achieved_bytes": achieved, "measured_kl": kl, "measure_seconds": seconds}


def plan_budget(work: Path, resume: bool, search: BudgetSearch) -> BudgetPlan:
    """`choose`, saved as ``work/budget.json``; a resumed run takes the saved choice instead of searching again
    (a search repeated on a GPU could break a near tie the other way and mix two choices in one export)."""
    path = work / "budget.json"
    plan = saved_choice(path, search.budget, search.units, search.options) if resume else None
    if plan is not None:
        search.console.print(f"budget {search.budget.text}: the choice of the run being resumed ({path})")
        return plan
    plan = choose(search)
    if search.ranks.main:
        atomic_json(plan.report(), path)
    return plan


def record_budget(
    plan: BudgetPlan,
    config: SalaConfig,
    source: Path,
    export: Path,
    samples: Sequence[torch.Tensor],
    device: torch.device,
    console: Console,
) -> None:
    """Measure what the export achieved (`budget_achieved`), add the budget report to its ``quant_report.json``
    (rewritten whole) and print the choice per kind of unit."""
    what = "budget: the export's KL to the source, layers"
    with Phases(not console.quiet) as progress, progress.phase(what, config.num_hidden_layers) as step:
        budget_achieved(plan, source, export, samples, device, step)
    report_path = export / "quant_report.json"
    report = json.loads(report_path.read_text())
    report["budget"] = plan.report()
    atomic_json(report, report_path)
    counts: dict[str, dict[str, int]] = {}
    for u, unit in enumerate(plan.units):
        key = f"{config.mixer_types[unit.layer]} {unit.name}"
        row = counts.setdefault(key, {})
        row[plan.option(u)] = row.get(plan.option(u), 0) + 1
    labels = sorted({o for unit in plan.units for o in unit.options}, key=lambda o: (o == "bf16", o))
    table = Table(title=f"Budget {plan.budget.text}: the option each group took (layers)")
    for col in ("group", *labels):
        table.add_column(col, justify="left" if col == "group" else "right")
    for key, row in counts.items():
        table.add_row(key, *[str(row.get(o, 0)) for o in labels])
    console.print(table)
    console.print(
        f"size: predicted {describe_bytes(plan.predicted_bytes, plan.weights, plan.base)}, achieved "
        f"{describe_bytes(plan.achieved['achieved_bytes'], plan.weights, plan.base)} (budget "
        f"{describe_bytes(plan.target, plan.weights, plan.base)}); KL to the source on the search windows: "
        f"predicted {plan.predicted_kl:.4g}, measured {plan.achieved['measured_kl']:.4g}"
    )
