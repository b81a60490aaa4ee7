"""GPTQModel-style ``dynamic`` rules: per-module bits / group size and exclusions.

``dynamic`` is an ordered dict ``pattern -> overrides``. vLLM and SGLang scan it in order and stop at the first
pattern that ``re.match``-es the module prefix: a ``-:`` pattern means the module is not quantized (served from a
plain ``weight``); a ``+:`` or unprefixed pattern overrides ``bits`` / ``group_size`` / ``desc_act`` / ``sym``.

The engines match their own module names, which are the *fused* ones for stacked parameters
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``), while vLLM's lightning layers keep ``q_proj``/``k_proj``/``v_proj``.
`build_dynamic` therefore writes rules that give the same answer for a checkpoint name and for its fused name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...model.layout import FUSED_OF, FUSED_PARAMETERS, fused_name, split_layer_name

__all__ = [
    "LinearPlan",
    "build_dynamic",
    "first_match",
    "linear_names_for_engines",
    "plan_for",
    "resolve",
]


@dataclass(frozen=True)
class LinearPlan:
    """Precision of one linear: ``bits`` None keeps it in bf16 (excluded from quantization)."""

    bits: int | None
    group_size: int


def _same(a: LinearPlan, b: LinearPlan) -> bool:
    """Plans are equal; excluded plans are equal whatever their group size."""
    if a.bits is None or b.bits is None:
        return a.bits is None and b.bits is None
    return a == b


def linear_names_for_engines(names: list[str]) -> list[str]:
    """``names`` plus the fused names the engines use for them, in first-seen order."""
    out = dict.fromkeys(names)
    for name in names:
        fused = fused_name(name)
        if fused is not None:
            out.setdefault(fused)
    return list(out)


def first_match(dynamic: Mapping[str, Mapping[str, Any]], module_name: str) -> str | None:
    """The first pattern of ``dynamic`` (with its ``-:`` / ``+:`` prefix) that ``re.match``-es the name."""
    for pattern in dynamic:
        body = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        if re.match(body, module_name):
            return pattern
    return None


def resolve(dynamic: Mapping[str, Mapping[str, Any]], module_name: str) -> tuple[bool, dict[str, Any]]:
    """Emulate vLLM ``get_dynamic_override``: ``(quantized, overrides)`` for ``module_name``.

    First pattern in order that ``re.match``-es wins; ``-:`` gives ``(False, {})``, a positive pattern
    ``(True, overrides)``; no match gives ``(True, {})``.
    """
    pattern = first_match(dynamic, module_name)
    if pattern is None:
        return True, {}
    if pattern.startswith("-:"):
        return False, {}
    return True, dict(dynamic[pattern])


def plan_for(
    dynamic: Mapping[str, Mapping[str, Any]], module_name: str, default_bits: int, default_group_size: int
) -> LinearPlan:
    """The `LinearPlan` that ``dynamic`` gives ``module_name`` on top of the top-level bits / group size."""
    quantized, overrides = resolve(dynamic, module_name)
    if not quantized:
        return LinearPlan(None, default_group_size)
    return LinearPlan(int(overrides.get("bits", default_bits)), int(overrides.get("group_size", default_group_size)))


def _layer_token(layers: set[int], present: set[int]) -> str:
    """Regex for a set of layer indices: ``\\d+`` when it is every layer holding the module kind."""
    if layers == present:
        return r"\d+"
    ordered = sorted(layers)
    return str(ordered[0]) if len(ordered) == 1 else "(?:" + "|".join(str(i) for i in ordered) + ")"


def _kinds_regex(kinds: list[str]) -> str:
    """Regex for module kinds (``self_attn.o_gate``, ``mlp.gate_up_proj`` ...), grouped by parent."""
    by_parent: dict[str, list[str]] = {}
    for kind in kinds:
        leaves = [kind, *FUSED_PARAMETERS[kind]] if kind in FUSED_PARAMETERS else [kind]
        for leaf in leaves:
            parent, child = leaf.split(".", 1)
            by_parent.setdefault(parent, []).append(child)
    parts = []
    for parent, children in by_parent.items():
        inner = children[0] if len(children) == 1 else "(?:" + "|".join(children) + ")"
        parts.append(f"{re.escape(parent)}\\.{inner}")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def build_dynamic(
    plans: Mapping[str, LinearPlan], default_bits: int, default_group_size: int, num_layers: int
) -> dict[str, dict[str, Any]]:
    """Ordered ``dynamic`` rules that give every linear of ``plans`` its plan, under its checkpoint name and
    under the fused name the engines use (``qkv_proj``, ``gate_up_proj``).

    Negative rules (excluded linears) come first, then positive rules for linears whose bits / group size
    differ from the defaults. A module kind treated alike in every layer that has it gets one ``\\d+`` rule.
    Raises ValueError for names outside ``model.layers.{i}.`` (lm_head is governed by the ``lm_head`` flag),
    for layer indices outside ``[0, num_layers)`` and for fused groups whose members have different plans.
    """
    # kind (``self_attn.o_gate`` or a fused kind ``self_attn.qkv_proj``) -> layer -> plan
    by_kind: dict[str, dict[int, LinearPlan]] = {}
    members_seen: dict[tuple[int, str], dict[str, LinearPlan]] = {}
    for name, plan in plans.items():
        parts = split_layer_name(name)
        if parts is None:
            raise ValueError(
                f"{name!r}: dynamic rules cover only decoder linears model.layers.{{i}}.<module>.<linear> "
                "(lm_head is set by the lm_head flag, embeddings are never quantized)"
            )
        layer, kind = parts
        if not 0 <= layer < num_layers:
            raise ValueError(f"{name!r}: layer index {layer} is outside 0-{num_layers - 1}")
        if plan.bits is not None and plan.bits <= 0:
            raise ValueError(f"{name!r}: bits={plan.bits} is not a valid bit width")
        if kind in FUSED_PARAMETERS:
            raise ValueError(f"{name!r}: give plans for the checkpoint linears, not the fused engine name")
        fused = FUSED_OF.get(kind)
        if fused is not None:
            members_seen.setdefault((layer, fused), {})[kind] = plan
            kind = fused
        by_kind.setdefault(kind, {})[layer] = plan

    for (layer, fused), got in members_seen.items():
        members = FUSED_PARAMETERS[fused]
        missing = [m for m in members if m not in got]
        if missing:
            raise ValueError(
                f"model.layers.{layer}.{fused}: no plan for {', '.join(missing)}; the engines fuse "
                f"{', '.join(members)} into one parameter, so plan all of them"
            )
        first = got[members[0]]
        if any(not _same(first, got[m]) for m in members[1:]):
            shown = ", ".join(f"{m}={_describe(got[m])}" for m in members)
            raise ValueError(
                f"model.layers.{layer}.{fused}: fused members must share one plan, got {shown} "
                "(the engines load them as one parameter)"
            )
        by_kind[fused][layer] = first

    default = LinearPlan(default_bits, default_group_size)
    negative: dict[str, set[int]] = {}
    positive: dict[LinearPlan, dict[str, set[int]]] = {}
    for kind, layers in by_kind.items():
        for layer, plan in layers.items():
            if plan.bits is None:
                negative.setdefault(kind, set()).add(layer)
            elif plan != default:
                positive.setdefault(plan, {}).setdefault(kind, set()).add(layer)

    dynamic: dict[str, dict[str, Any]] = {}
    for token, kinds in _group_by_token(negative, by_kind):
        dynamic[f"-:model\\.layers\\.{token}\\.{_kinds_regex(kinds)}$"] = {}
    for plan in sorted(positive, key=lambda p: (p.bits or 0, p.group_size)):
        for token, kinds in _group_by_token(positive[plan], by_kind):
            rule = f"+:model\\.layers\\.{token}\\.{_kinds_regex(kinds)}$"
            dynamic[rule] = {"bits": plan.bits, "group_size": plan.group_size}

    _verify(dynamic, plans, default_bits, default_group_size)
    return dynamic


def _describe(plan: LinearPlan) -> str:
    return "bf16" if plan.bits is None else f"{plan.bits}-bit/g{plan.group_size}"


def _group_by_token(
    layers_of_kind: dict[str, set[int]], by_kind: dict[str, dict[int, LinearPlan]]
) -> list[tuple[str, list[str]]]:
    """Kinds grouped by their layer-index regex, in a stable order."""
    groups: dict[str, list[str]] = {}
    for kind in sorted(layers_of_kind):
        token = _layer_token(layers_of_kind[kind], set(by_kind[kind]))
        groups.setdefault(token, []).append(kind)
    return sorted(groups.items(), key=lambda item: (item[0] != r"\d+", item[0]))


def _verify(
    dynamic: Mapping[str, Mapping[str, Any]], plans: Mapping[str, LinearPlan], default_bits: int, default_gs: int
) -> None:
    """Check that the rules resolve every checkpoint name and every fused name to its plan."""
    expected = dict(plans)
    for name, plan in plans.items():
        fused = fused_name(name)
        if fused is not None:
            expected.setdefault(fused, plan)
    for name, want in expected.items():
        got = plan_for(dynamic, name, default_bits, default_gs)
        if not _same(got, want):
            raise RuntimeError(f"dynamic rules resolve {name} to {_describe(got)}, planned {_describe(want)}")
