"""Every setting of a quantization run, with its one default: the schema behind recipe files, the ``gptq`` /
``nvfp4`` / ``calibrate`` flags and the quantizers' layer options (which take their defaults from here).

Sections are frozen pydantic models that forbid unknown keys; `defaults` gives a method's complete settings.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from .model.layout import GROUP_NAMES

SMOOTH_GROUPS: dict[str, tuple[str, ...]] = {
    "gptq": GROUP_NAMES,
    "rtn": GROUP_NAMES,
    "nvfp4": ("attn_in", "attn_out", "mlp_in"),  # not up_proj -> down_proj
}
"""The input groups each method may smooth (all of them by default)."""
SMOOTH_BY_DEFAULT: dict[str, bool] = {"gptq": False, "rtn": False, "nvfp4": True}
"""Whether a method smooths when the recipe does not say: off for weight-only GPTQ (with MSE scales SmoothQuant
raised the perplexity increase on text outside the calibration set for every alpha tried: docs/gptq.md)."""
SIZE_EXPECTED = "expected a size above zero, such as 4GB, 500MB or 2GiB"


def parse_size(text: str) -> int:
    """Bytes of ``"4GB"``, ``"500MB"``, ``"2GiB"`` or a plain byte count; a `ValueError` for anything else,
    zero included (no shard, budget or file is zero bytes)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    size = int(t) if t.isdigit() else None
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if size is None and t.endswith(unit):
            try:
                size = int(float(t[: -len(unit)]) * mult)
            except (ValueError, OverflowError):  # not a number, or NaN / inf
                break
    if size is None or size <= 0:
        raise ValueError(f"size {text!r}: {SIZE_EXPECTED}")
    return size


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(_Section):
    sources: list[str] = Field(default_factory=list, description="files, folders or hf:NAME datasets")
    max_samples: int | None = Field(96, ge=1)
    max_len: int = Field(131072, ge=1)
    min_len: int = Field(1, ge=1)
    shuffle: bool = False
    seed: int = 0
    field: str | None = Field(None, min_length=1, description="the record field holding the text")
    bos: bool = Field(True, description="begin every sample with the tokenizer's BOS, as a served prompt begins")


class Smoothing(_Section):
    enabled: bool | None = Field(None, description="default: SMOOTH_BY_DEFAULT (off for gptq and rtn, on for nvfp4)")
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    groups: list[str] | None = Field(None, description="default: all the method's groups")


def _regex(v: str) -> str:
    try:
        re.compile(v)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression ({exc})") from exc
    return v


Regex = Annotated[str, AfterValidator(_regex)]
"""A regular expression (``re.search``ed in linear names), checked when the recipe is."""


class BitsRuleModel(_Section):
    match: Regex
    bits: Literal[4, 8, 16] | None = None
    group_size: Literal[-1, 32, 64, 128] | None = None


class Quantization(_Section):
    bits: Literal[4, 8, 16] = 4
    group_size: Literal[-1, 32, 64, 128] = 128
    minicpm4_bits: Literal[4, 8, 16] | None = None
    lightning_bits: Literal[4, 8, 16] | None = None
    layer_bits: str = Field("", description='e.g. "0:8,2-7:4" (16 = bf16)')
    rules: list[BitsRuleModel] = Field(default_factory=list, description="first match wins")
    exclude: list[Regex] = Field(default_factory=list)
    budget: str | None = Field(
        None, description='size of the export, e.g. "6.5GB", or "4.5bits" per weight: the options chosen by measurement'
    )
    budget_windows: int = Field(4, ge=1, description="calibration windows the budget search measures damage on")
    budget_seq_len: int = Field(512, ge=2, description="tokens per budget search window")

    @field_validator("budget")
    @classmethod
    def _budget(cls, v: str | None) -> str | None:
        if v is not None:
            from .budget.size import parse_budget

            parse_budget(v)
        return v


class GPTQSection(_Section):
    damp: float = Field(0.01, gt=0.0, le=1.0)
    block_size: int = Field(128, ge=1)
    act_order: bool = False
    mse: bool = True
    fp64: bool = False
    hessian_weighting: Literal["samples", "tokens"] = "samples"
    quantize_lm_head: bool = Field(False, description="refused when true: no engine serves a quantized lm_head")


class NVFP4Section(_Section):
    dense_all: bool = False
    exclude: list[Regex] = Field(default_factory=list)
    mse_iters: int = Field(80, ge=0, le=10000)
    mse_max_shrink: float = Field(0.6, ge=0.0, lt=1.0)
    mse_max_grow: float = Field(
        1.5,
        ge=1.0,
        le=4.0,
        description="largest tried block scale, as a multiple of the plain one (the global scale leaves it room; "
        "1: none)",
    )
    input_scale: Literal["max", "mse"] = Field(
        "max", description="activation global scale: ModelOpt's calibrated max, or the least-error multiple of it"
    )
    rounding: Literal["nearest", "gptq"] = Field(
        "gptq",
        description="nearest E2M1 value under the block scales, or GPTQ's column sweep carrying each column's error "
        "into the columns not yet rounded (needs full input Hessians)",
    )
    static_scales: bool = Field(
        False, description="gptq rounding: block scales searched before the sweep, else per block as it reaches them"
    )


class Engine(_Section):
    device: str = "auto"
    chunk_tokens: int = Field(8192, ge=1)
    propagate: Literal["quantized", "float"] = "quantized"


class Export(_Section):
    shard_size: str = "4GB"
    checkpoint_format: Literal["gptq", "modelopt"] | None = None
    tp: int = Field(1, ge=1)
    marlin_fallback: bool = True

    @field_validator("shard_size", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):  # a byte count, as YAML reads a plain number
            v = str(v)
        if not isinstance(v, str):
            return v  # refused as not a string
        try:
            parse_size(v)
        except ValueError:
            raise ValueError(SIZE_EXPECTED) from None
        return v


class EvalGate(_Section):
    data: str | None = Field(None, description="held-out text (same formats as calibration)")
    seq_len: int = Field(1024, ge=2)
    windows: int = Field(8, ge=1)
    max_ppl_increase: float | None = Field(None, ge=0.0, description="fraction, e.g. 0.05 = +5%")
    max_kl: float | None = Field(None, ge=0.0)
    min_top1: float | None = Field(None, ge=0.0, le=1.0)
    activations: Literal["auto", "fp4", "bf16"] = Field(
        "auto", description="auto: NVFP4 exports scored W4A4 (FP4 activations, as Blackwell runs them)"
    )


class Recipe(_Section):
    method: Literal["gptq", "nvfp4", "rtn"]
    description: str = ""
    calibration: Calibration = Calibration()
    smoothing: Smoothing = Smoothing()
    quantization: Quantization = Quantization()
    gptq: GPTQSection = GPTQSection()
    nvfp4: NVFP4Section = NVFP4Section()
    engine: Engine = Engine()
    export: Export = Export()
    eval: EvalGate = EvalGate()

    def to_yaml(self) -> str:
        """The recipe as YAML, without the settings its method does not read (`NOT_READ`): what it runs, and a
        file that loads back to the same recipe."""
        data = self.model_dump(mode="json")
        for key in NOT_READ[self.method]:
            section, _, name = key.partition(".")
            if name:
                data[section].pop(name)
            else:
                data.pop(section)
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


NOT_READ: dict[str, tuple[str, ...]] = {
    "gptq": ("nvfp4",),
    "rtn": ("nvfp4", "gptq.damp", "gptq.block_size", "gptq.act_order"),
    "nvfp4": (
        "gptq",
        "quantization.bits",
        "quantization.group_size",
        "quantization.minicpm4_bits",
        "quantization.lightning_bits",
        "quantization.layer_bits",
        "quantization.rules",
        "export.tp",
        "export.marlin_fallback",
    ),
}
"""The sections and keys each method's run never reads (rtn rounds without a solve; NVFP4 has its own grid and
no tensor-parallel check). A recipe that sets one to other than its default is refused: it would change
nothing."""
GATE_KEYS = ("seq_len", "windows", "max_ppl_increase", "max_kl", "min_top1", "activations")
"""The ``eval`` keys read only when ``eval.data`` is set (without data there is no gate)."""


def ignored_settings(recipe: Recipe) -> list[tuple[str, str]]:
    """``(section, key)`` of every setting of ``recipe`` that its run would not read but that differs from its
    default: a key of `NOT_READ` for its method, or an ``eval`` key of `GATE_KEYS` without ``eval.data``.
    Defaults are allowed so that any recipe `Recipe.to_yaml` wrote, by this version or an earlier one that
    still wrote every section, loads."""
    base = defaults(recipe.method)
    keys = [k for k in NOT_READ[recipe.method] if "." in k]
    keys += [f"{k}.{f}" for k in NOT_READ[recipe.method] if "." not in k for f in type(getattr(base, k)).model_fields]
    if recipe.eval.data is None:
        keys += [f"eval.{k}" for k in GATE_KEYS]
    out = []
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(recipe, section), name) != getattr(getattr(base, section), name):
            out.append((section, name))
    return out


def defaults(method: str) -> Recipe:
    """The settings of ``method`` (gptq, rtn or nvfp4) when nothing is given."""
    return Recipe.model_validate({"method": method})


def smoothing_for(recipe: Recipe) -> tuple[float | None, tuple[str, ...]]:
    """``(alpha, groups)`` the recipe's quantizer smooths with: alpha None when smoothing is off."""
    enabled = SMOOTH_BY_DEFAULT[recipe.method] if recipe.smoothing.enabled is None else recipe.smoothing.enabled
    groups = tuple(recipe.smoothing.groups) if recipe.smoothing.groups is not None else SMOOTH_GROUPS[recipe.method]
    return (recipe.smoothing.alpha if enabled else None), groups
