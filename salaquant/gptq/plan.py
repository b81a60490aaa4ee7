"""Which bits each linear gets: ``--bits``, ``--minicpm4-bits``, ``--lightning-bits``, ``--layer-bits``, excludes.

Precedence per layer: ``--layer-bits`` entry, then the layer-type option, then ``--bits``. 16 means keep the
layer's linears in bf16. Fused groups (q/k/v, gate/up) always share bits and group size because bits are
chosen per layer; ``--exclude`` patterns that would split a fused group are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..formats.gptq_v1.dynamic import LinearPlan
from ..model.config import LIGHTNING, SPARSE, SalaConfig
from ..model.layout import FUSED_PARAMETERS, layer_linears, linear_names, no_match, unmatched
from ..settings import defaults

_DEFAULTS = defaults("gptq")

SUPPORTED_BITS = (4, 8, 16)


class PlanError(ValueError):
    """An impossible bits plan; the message names the option and the value (``rule``: the offending rule,
    ``exclude``: the offending ``--exclude`` pattern, by index)."""

    def __init__(self, message: str, rule: int | None = None, exclude: int | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.exclude = exclude


def parse_layer_bits(spec: str, num_layers: int) -> dict[int, int]:
    """``"0:8,2-7:4"`` -> {0: 8, 2: 4, ..., 7: 4}."""
    out: dict[int, int] = {}
    if not spec.strip():
        return out
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*:\s*(\d+)\s*", part)
        if not m:
            raise PlanError(f"--layer-bits entry {part!r}: expected INDEX:BITS or FIRST-LAST:BITS")
        first, last, bits = int(m[1]), int(m[2] or m[1]), int(m[3])
        if last < first or last >= num_layers:
            raise PlanError(f"--layer-bits entry {part!r}: layers must lie in 0-{num_layers - 1}")
        if bits not in SUPPORTED_BITS:
            raise PlanError(f"--layer-bits entry {part!r}: bits must be one of {SUPPORTED_BITS}")
        for i in range(first, last + 1):
            out[i] = bits
    return out


@dataclass(frozen=True)
class BitsRule:
    """Linears whose name matches ``match`` (``re.search``) get these bits (16: bf16) and/or group size;
    the first matching rule wins and overrides the per-layer / per-type / default bits."""

    match: str
    bits: int | None = None
    group_size: int | None = None


@dataclass(frozen=True)
class BitsOptions:
    bits: int = 4
    group_size: int = 128
    minicpm4_bits: int | None = None
    lightning_bits: int | None = None
    layer_bits: str = ""
    exclude: tuple[str, ...] = ()  # regexes matched (re.search) against full linear names
    rules: tuple[BitsRule, ...] = ()
    budget: str | None = None  # the bits of every group chosen by measurement under this size (salaquant.budget)
    budget_windows: int = _DEFAULTS.quantization.budget_windows
    budget_seq_len: int = _DEFAULTS.quantization.budget_seq_len


def _budget_conflicts(opts: BitsOptions) -> list[str]:
    """The bits options a budget cannot be combined with (it chooses every group's bits itself)."""
    given = [
        ("--bits", opts.bits != 4),
        ("--minicpm4-bits", opts.minicpm4_bits is not None),
        ("--lightning-bits", opts.lightning_bits is not None),
        ("--layer-bits", bool(opts.layer_bits.strip())),
        ("rules with bits", any(r.bits is not None for r in opts.rules)),
    ]
    return [name for name, set_ in given if set_]


def build_plan(config: SalaConfig, opts: BitsOptions) -> dict[str, LinearPlan]:
    """The plan of every decoder linear, by full checkpoint name (``model.layers.{i}.{linear}``). With a budget,
    the 4-bit plan its search starts from (excludes and group sizes applied)."""
    if opts.budget is not None:
        conflicts = _budget_conflicts(opts)
        if conflicts:
            raise PlanError(
                f"--budget {opts.budget} chooses the bits of every group itself: drop {', '.join(conflicts)} "
                "(keep --exclude for linears that must stay bf16)"
            )
        if opts.budget_windows < 1 or opts.budget_seq_len < 2:
            raise PlanError("the budget search needs at least one window of at least 2 tokens")
    checks = (("--bits", opts.bits), ("--minicpm4-bits", opts.minicpm4_bits), ("--lightning-bits", opts.lightning_bits))
    for name, value in checks:
        if value is not None and value not in SUPPORTED_BITS:
            raise PlanError(f"{name} {value}: expected one of {SUPPORTED_BITS}")
    if opts.group_size not in (-1, 32, 64, 128):
        raise PlanError(f"--group-size {opts.group_size}: expected -1, 32, 64 or 128 (gptq_marlin group sizes)")
    per_layer = parse_layer_bits(opts.layer_bits, config.num_hidden_layers)
    patterns = []
    for pat in opts.exclude:
        try:
            patterns.append(re.compile(pat))
        except re.error as exc:
            raise PlanError(f"--exclude {pat!r}: not a valid regular expression ({exc})") from exc
    rules = []
    for k, rule in enumerate(opts.rules):
        if rule.bits is not None and rule.bits not in SUPPORTED_BITS:
            raise PlanError(f"rules[{k}] bits {rule.bits}: expected one of {SUPPORTED_BITS}", rule=k)
        if rule.group_size is not None and rule.group_size not in (-1, 32, 64, 128):
            raise PlanError(f"rules[{k}] group_size {rule.group_size}: expected -1, 32, 64 or 128", rule=k)
        try:
            rules.append(re.compile(rule.match))
        except re.error as exc:
            raise PlanError(f"rules[{k}] match {rule.match!r}: not a valid regular expression ({exc})", rule=k) from exc
    names = linear_names(config)
    k = unmatched(patterns, names)
    if k is not None:
        raise PlanError(no_match("--exclude", opts.exclude[k], names), exclude=k)
    k = unmatched(rules, names)
    if k is not None:
        raise PlanError(no_match(f"rules[{k}] match", opts.rules[k].match, names), rule=k)
    plan: dict[str, LinearPlan] = {}
    matched_rule: dict[str, int] = {}
    for i, kind in enumerate(config.mixer_types):
        kind_bits = opts.minicpm4_bits if kind == SPARSE else opts.lightning_bits if kind == LIGHTNING else None
        bits = per_layer.get(i, kind_bits if kind_bits is not None else opts.bits)
        for spec in layer_linears(config, kind):
            name = f"model.layers.{i}.{spec.name}"
            b, gs = bits, opts.group_size
            for k, pattern in enumerate(rules):
                if pattern.search(name):
                    b = opts.rules[k].bits if opts.rules[k].bits is not None else b
                    gs = opts.rules[k].group_size if opts.rules[k].group_size is not None else gs
                    matched_rule[name] = k
                    break
            excluded = b == 16 or any(p.search(name) for p in patterns)
            plan[name] = LinearPlan(bits=None if excluded else b, group_size=gs)
        for fused, members in FUSED_PARAMETERS.items():
            names = [f"model.layers.{i}.{m}" for m in members]
            if len({plan[n] for n in names}) > 1:
                hit = sorted({matched_rule[n] for n in names if n in matched_rule})
                raise PlanError(
                    f"{'rules[' + str(hit[0]) + ']' if hit else '--exclude'} would split the fused "
                    f"model.layers.{i}.{fused} ({', '.join(members)}): serving engines load them as one parameter, "
                    "so give all of them the same bits and group size (or exclude all of them)",
                    rule=hit[0] if hit else None,
                )
    return plan


def check_tp(config: SalaConfig, tp: int, largest: int = 64) -> None:
    """Refuse a tensor-parallel size over which SGLang cannot split this model (naming a linear that does not
    split and the sizes up to ``largest`` that do): the export would pass no check at it, nor be served."""
    from ..formats.gptq_v1.check import tp_problems

    problems = tp_problems(config, tp)
    if problems:
        fits = [str(t) for t in range(1, largest + 1) if not tp_problems(config, t)]
        raise PlanError(
            f"--tp {tp}: SGLang cannot split this model over {tp} GPUs ({problems[0]}); tensor-parallel sizes "
            f"that split every layer: {', '.join(fits)}"
        )


def check_marlin_leaves_some(plan: dict[str, LinearPlan], excluded: dict[str, list[str]], tp: int) -> None:
    """Refuse a plan whose every quantized linear `marlin_exclusions` had to keep in bf16 (nothing to export)."""
    if excluded and all(p.bits is None for p in plan.values()):
        own = [reasons[0] for reasons in excluded.values() if not reasons[0].startswith("fused with")]
        raise PlanError(
            f"--tp {tp}: gptq_marlin cannot serve any linear the plan quantizes at tp={tp} (e.g. "
            f"{(own or [next(iter(excluded))])[0]}), so nothing would be exported as GPTQ; choose another --tp or "
            "other bits"
        )


def marlin_exclusions(config: SalaConfig, plan: dict[str, LinearPlan], tp: int) -> dict[str, list[str]]:
    """Keep in bf16 the linears gptq_marlin cannot serve at this tensor-parallel size (whole fused groups),
    changing ``plan`` in place; returns {linear: reasons} for the linears it excluded."""
    from ..formats.gptq_v1.check import marlin_shape_problems

    excluded: dict[str, list[str]] = {}
    for i, kind in enumerate(config.mixer_types):
        specs = {s.name: s for s in layer_linears(config, kind)}
        problems = {}
        for name, spec in specs.items():
            full = f"model.layers.{i}.{name}"
            p = plan[full]
            if p.bits is not None:
                found = marlin_shape_problems(config, full, spec.in_features, spec.out_features, p.group_size, tp)
                if found:
                    problems[name] = found
        for members in FUSED_PARAMETERS.values():
            if any(m in problems for m in members):
                for m in members:
                    problems.setdefault(m, [f"fused with {', '.join(x for x in members if x in problems)}"])
        for name, reasons in problems.items():
            full = f"model.layers.{i}.{name}"
            plan[full] = LinearPlan(bits=None, group_size=plan[full].group_size)
            excluded[full] = reasons
    return excluded
