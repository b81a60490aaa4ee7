"""Run a validated recipe: the one path behind ``salaquant run`` and the ``gptq`` / ``nvfp4`` commands."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from .calibration.calib_data import CalibOptions
from .export import GATE_NAME
from .outputs import ExportRejected, check_no_overlap, check_output
from .recipe import RecipeError, key_line
from .settings import EvalGate, Recipe, parse_size, smoothing_for

if TYPE_CHECKING:
    import torch

    from .driver import Method


class GateFailed(ExportRejected):
    """The complete export missed a threshold of the recipe's eval gate (it is kept at ``OUTPUT.gate-failed``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "gate")


def calib_options(r: Recipe) -> CalibOptions:
    """The recipe's calibration settings, less its sources (the option fields carry the settings' names)."""
    return CalibOptions(**r.calibration.model_dump(exclude={"sources"}))


def run_recipe(
    recipe: Recipe,
    model: Path,
    output: Path,
    console: Console,
    *,
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    recipe_path: str | None = None,
) -> Path:
    """Quantize ``model`` into ``output`` as the recipe says; the resolved recipe is saved as ``recipe.yaml``.

    With an eval gate, its data is read before any model work (`gate_windows`) and the gate scores the complete
    export where it was written, beside ``output``: it is moved to ``output`` only when the gate passes; a failed
    gate leaves it at ``OUTPUT.gate-failed`` (and ``output`` as it was) and raises `GateFailed`."""
    if not recipe.calibration.sources:
        raise RecipeError(
            "calibration.sources is empty: list files in the recipe or pass "
            "--set calibration.sources=[FILE] (or --calib FILE)"
        )
    if recipe_path is not None and Path(recipe_path).exists():
        check_no_overlap(output, [("recipe", Path(recipe_path))])
    accept = None
    if recipe.eval.data is not None:  # the output first: reading the gate's data may take a while
        inputs = [("input checkpoint", model)]
        if not recipe.eval.data.startswith("hf:"):
            inputs.append(("eval data", Path(recipe.eval.data)))
        check_output(output, overwrite, resume, inputs)
        accept = _gate(recipe, model, console)
    _quantize(recipe, model, output, console, resume, overwrite, show_progress, recipe_path, accept)
    return output


def _gate(recipe: Recipe, model: Path, console: Console) -> Callable[[Path], None]:
    """The recipe's eval gate as a check of a complete export, its data read now (before any model work)."""
    from .model.loading import validate_source

    validate_source(model)  # the gate's data is tokenized with the source's tokenizer: the source first
    wins = gate_windows(model, recipe.eval)

    def accept(export: Path) -> None:
        result = eval_gate(model, export, recipe.eval, recipe.engine.device, wins)
        (export / GATE_NAME).write_text(json.dumps(result, indent=2))
        console.print(
            f"eval gate: ppl {result['ppl_source']:.3f} -> {result['ppl_quantized']:.3f} "
            f"({100 * result['ppl_increase']:+.2f}%), KL {result['kl']:.4f}, top-1 {100 * result['top1']:.2f}%"
        )
        if not result["passed"]:
            raise GateFailed("eval gate failed: " + "; ".join(result["failures"]))

    return accept


def _quantize(
    recipe: Recipe,
    model: Path,
    output: Path,
    console: Console,
    resume: bool,
    overwrite: bool,
    show_progress: bool,
    recipe_path: str | None,
    accept: Callable[[Path], None] | None,
) -> None:
    """The recipe's quantizer, run into ``output`` (``accept``: its eval gate)."""
    method_of = _gptq_method if recipe.method in ("gptq", "rtn") else _nvfp4_method
    e = recipe.engine
    execution = {
        "device": e.device,
        "chunk_tokens": e.chunk_tokens,
        "propagate": e.propagate,
        "max_shard_bytes": parse_size(recipe.export.shard_size),
        "resume": resume,
        "overwrite": overwrite,
        "show_progress": show_progress,
    }
    from .driver import run_method

    method = method_of(recipe, execution, smoothing_for(recipe))
    extra = {"recipe.yaml": recipe.to_yaml()}
    try:
        run_method(model, output, recipe.calibration.sources, calib_options(recipe), method, console, extra, accept)
    except ValueError as exc:
        refusal = _refusal(recipe, recipe_path, exc)
        if refusal is None:
            raise
        raise refusal from exc


Smoothing = tuple[float | None, tuple[str, ...]]


def _gptq_method(recipe: Recipe, execution: dict[str, Any], smoothing: Smoothing) -> Method:
    """The GPTQ method with the recipe's bits plan and solver, ``execution`` (``driver.Execution``'s fields) and the
    export's checks (``rtn``: the same grid, no solve)."""
    from .gptq.command import GPTQMethod, RunOptions
    from .gptq.layer import GPTQLayerOptions
    from .gptq.plan import BitsOptions, BitsRule

    q, g, (alpha, groups) = recipe.quantization, recipe.gptq, smoothing
    bits = BitsOptions(
        **q.model_dump(exclude={"exclude", "rules"}),
        exclude=tuple(q.exclude),
        rules=tuple(BitsRule(x.match, x.bits, x.group_size) for x in q.rules),
    )
    method = "rtn" if recipe.method == "rtn" else "gptq"
    solver = g.model_dump(exclude={"quantize_lm_head"})  # refused before any run: the recipe's own check
    layer = GPTQLayerOptions(**solver, smooth_alpha=alpha, smooth_groups=groups, method=method)
    run = RunOptions(**execution, tp=recipe.export.tp, marlin_fallback=recipe.export.marlin_fallback)
    return GPTQMethod(bits, layer, run)


def _nvfp4_method(recipe: Recipe, execution: dict[str, Any], smoothing: Smoothing) -> Method:
    """The NVFP4 method with the recipe's exclusions, scale search and rounding, and ``execution``."""
    from .nvfp4.command import NVFP4Method, NVFP4RunOptions
    from .nvfp4.layer import NVFP4LayerOptions

    q, n, (alpha, groups) = recipe.quantization, recipe.nvfp4, smoothing
    search = n.model_dump(exclude={"dense_all", "exclude"})
    layer = NVFP4LayerOptions(**search, smooth_alpha=alpha, smooth_groups=groups)
    run = NVFP4RunOptions(
        dense_all=n.dense_all,
        exclude=tuple(n.exclude + q.exclude),
        budget=q.budget,
        budget_windows=q.budget_windows,
        budget_seq_len=q.budget_seq_len,
        **execution,
    )
    return NVFP4Method(layer, run)


def _refusal(recipe: Recipe, recipe_path: str | None, exc: ValueError) -> RecipeError | None:
    """A plan's refusal of a bits rule or an exclusion, said of the recipe key that gave it (file, line, key);
    None for any other error, or without a recipe file."""
    from .gptq.plan import PlanError
    from .nvfp4.plan import NVFP4PlanError

    if recipe_path is None or not isinstance(exc, (PlanError, NVFP4PlanError)):
        return None
    if isinstance(exc, PlanError) and exc.rule is not None:
        key = ("quantization", "rules", exc.rule)
        return RecipeError(f"{key_line(recipe_path, key)}: quantization.{exc}")
    if exc.exclude is None:
        return None
    k, own = exc.exclude, recipe.nvfp4.exclude
    if isinstance(exc, PlanError):
        key = ("quantization", "exclude", k)
    else:  # NVFP4's exclusions are nvfp4.exclude, then quantization.exclude
        key = ("nvfp4", "exclude", k) if k < len(own) else ("quantization", "exclude", k - len(own))
    return RecipeError(f"{key_line(recipe_path, key)}: {key[0]}.{key[1]}[{key[2]}]: {exc}")


def gate_windows(source: Path, gate: EvalGate) -> list[torch.Tensor]:
    """The token windows the gate scores: ``gate.data`` read and tokenized with the source's tokenizer. A
    `RecipeError` names ``eval.data`` when it cannot be read or holds fewer than ``eval.seq_len`` tokens."""
    from .calibration.calib_data import CalibrationError
    from .eval.data import load_eval_text
    from .eval.perplexity import windows
    from .workflow import load_tokenizer

    assert gate.data is not None
    tokenizer = load_tokenizer(source)
    try:
        text = load_eval_text(gate.data, tokenizer, tokenizer.eos_token_id)
    except (CalibrationError, OSError) as exc:
        raise RecipeError(f"eval.data: {exc}") from exc
    wins = windows(text.tokens, gate.seq_len, gate.windows)
    if not wins:
        raise RecipeError(
            f"eval.data {gate.data}: {text.tokens.numel()} tokens, fewer than eval.seq_len={gate.seq_len}"
        )
    return wins


def eval_gate(
    source: Path, quantized: Path, gate: EvalGate, device: str = "auto", wins: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """Perplexity, KL and top-1 agreement of the export against its source on ``gate.data`` (dense attention;
    ``wins``: its windows, when `gate_windows` has read them already), measured and gated by the code behind
    ``salaquant eval``."""
    from .devices import resolve_device
    from .eval.metrics import ModelPair, compare_windows
    from .eval.thresholds import Thresholds
    from .model.loading import load_model

    dev = resolve_device(device)
    if wins is None:
        wins = gate_windows(source, gate)
    from .io.reader import CheckpointReader
    from .runtime.load import checkpoint_format, load, resolve_activations

    with CheckpointReader(quantized) as reader:
        activations = resolve_activations(gate.activations, checkpoint_format(reader))
    reference = load_model(source, device=dev)
    fp4 = activations == "fp4"
    model = load(quantized, device=dev, activations="fp4") if fp4 else load_model(quantized, device=dev)
    s = compare_windows(ModelPair(reference, model, "dense", dev), wins)[0].summary()
    out: dict[str, Any] = {
        "ppl_source": s["ppl_source"],
        "ppl_quantized": s["ppl_quantized"],
        "ppl_increase": s["ppl_increase"],
        "kl": s["kl"],
        "top1": s["top1"],
        "windows": len(wins),
        "seq_len": gate.seq_len,
        "activations": activations,
    }
    thresholds = Thresholds(max_ppl_increase=gate.max_ppl_increase, max_kl=gate.max_kl, min_top1=gate.min_top1)
    checks = thresholds.check({"perplexity": s})
    out["failures"] = [c["message"] for c in checks if not c["passed"]]
    out["passed"] = not out["failures"]
    return out
