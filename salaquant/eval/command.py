"""``run_eval``: format check, then the quantized model against its source on the same inputs, then the gates.

Order of work: every input is validated before any model is loaded (paths, configs, compatibility, options,
data, report folder); the format checker of the export code runs next and a failed check stops eval; then
perplexity / KL / top-1 on the held-out windows (plus a rerun of the first window), NIAH, greedy generation,
per-layer errors; the thresholds; the report.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..kernels.backend import check_backend
from ..model.kv_cache_dtype import use_kv_cache_dtype
from ..model.sampling import Sampling
from ..progress import Phases
from . import generation as gen
from . import layers as lay
from . import niah as nh
from . import report
from . import tasks as tk
from .data import load_eval_text
from .inputs import (
    auto_niah_lengths,
    check_gate_needs,
    check_positions,
    checked_report_dir,
    compatibility_problems,
    first_length,
    format_check,
    open_checkpoint,
)
from .metrics import ModelPair, compare_windows
from .options import EvalInputError, EvalOptions
from .perplexity import windows as make_windows
from .scoring import name_outliers, niah_result, run_measures, spread, tasks_result
from .thresholds import Thresholds


def run_eval(
    quantized: Path,
    reference: Path,
    options: EvalOptions | None = None,
    thresholds: Thresholds | None = None,
    report_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Evaluate ``quantized`` against ``reference``; returns the result (also written as ``eval.json`` and
    ``eval.png`` into ``report_dir`` when one is given; nothing is written otherwise). ``result["passed"]`` is False
    when a threshold was missed. Raises ``EvalInputError`` / ``CheckpointError`` / ``ConfigError`` /
    ``CalibrationError`` on bad input and ``CheckError`` when the format check fails."""
    started = time.perf_counter()  # timings_s["prepare"]: imports, configs, tokenizer, text and prompts
    from .. import __version__
    from ..devices import resolve_device
    from ..runtime.load import checkpoint_format, load, resolve_activations
    from ..workflow import load_tokenizer

    opts = options or EvalOptions()
    gates = thresholds or Thresholds()
    console = console or Console()
    opts.validate()
    check_backend(opts.backend, resolve_device(opts.device))  # what loading the models would refuse, first
    quantized, reference = Path(quantized), Path(reference)
    qcfg, qreader = open_checkpoint(quantized, "quantized checkpoint")
    rcfg, rreader = open_checkpoint(reference, "--reference")
    problems = compatibility_problems(qcfg, rcfg)
    if problems:
        more = "; ..." if len(problems) > 4 else ""
        raise EvalInputError(f"{quantized} is not an export of {reference}: " + "; ".join(problems[:4]) + more)
    qfmt, rfmt = checkpoint_format(qreader), checkpoint_format(rreader)
    if qfmt == "bf16" and opts.kv_cache == "bf16":
        raise EvalInputError(
            f"{quantized} is a bf16 checkpoint (config.json has no quantization_config), not an export: pass the "
            "GPTQ or NVFP4 export first and its bf16 source as --reference (or, to score an FP8 KV cache alone, the "
            "bf16 checkpoint with --kv-cache fp8_e4m3 or fp8_e5m2)"
        )
    if rfmt != "bf16":
        raise EvalInputError(
            f"--reference {reference} is a {rfmt} export, not a bf16 source: pass the checkpoint the export was "
            "made from as --reference"
        )
    if opts.attention == "sparse" and qcfg.sparse_config is None:
        raise EvalInputError(f"--attention sparse: {quantized}/config.json has no sparse_config")
    niah_lengths = opts.niah_lengths
    notes: list[str] = []
    if niah_lengths is None:
        niah_lengths = auto_niah_lengths(qcfg, quantized, notes)
    check_positions(opts, niah_lengths, qcfg, quantized)
    check_gate_needs(gates, opts, niah_lengths)
    folder = checked_report_dir(Path(report_dir), quantized, reference) if report_dir is not None else None
    has_tokenizer = any((reference / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    try:
        tokenizer = load_tokenizer(reference if has_tokenizer else quantized)
    except (OSError, ValueError) as exc:
        raise EvalInputError(f"no usable tokenizer in {reference} or {quantized}: {exc}") from exc
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else first_length(rcfg.eos_token_id)
    unk_id = tokenizer.unk_token_id
    text = load_eval_text(opts.data, tokenizer, eos_id, opts.field)
    wins = make_windows(text.tokens, opts.max_len, opts.windows)
    if not wins:
        raise EvalInputError(
            f"data {text.source}: {text.tokens.numel()} tokens, fewer than one window of --max-len {opts.max_len}"
        )
    try:
        cases = [
            nh.make_case(tokenizer, n, d, opts.seed, tokenizer.bos_token_id)
            for n in niah_lengths
            for d in opts.niah_depths
        ]
    except ValueError as exc:
        raise EvalInputError(f"--niah: {exc}") from exc
    task_lengths = opts.task_lengths if opts.task_lengths is not None else list(niah_lengths or [opts.max_len])
    try:
        task_cases = [
            tk.make_task_case(tokenizer, task, n, i, opts.seed, tokenizer.bos_token_id)
            for task in opts.tasks
            for n in task_lengths
            for i in range(opts.task_samples)
        ]
    except ValueError as exc:
        raise EvalInputError(f"--tasks: {exc}") from exc
    if opts.prompts_file is not None:
        prompts = gen.load_prompts(Path(opts.prompts_file), tokenizer)
    else:
        prompts = list(opts.prompts) if opts.prompts is not None else list(gen.BUILTIN_PROMPTS[: opts.gen_prompts])
    if len(wins) < opts.windows:
        notes.append(
            f"the data holds {len(wins)} windows of {opts.max_len} tokens, fewer than --windows {opts.windows}"
        )

    t0 = time.perf_counter()
    timings: dict[str, float] = {"prepare": t0 - started}
    if qfmt == "bf16":  # the KV cache's format alone is scored: there is no export format to check
        check = {"status": "not run", "detail": f"bf16 weights: only the {opts.kv_cache} KV cache differs"}
    else:
        check = format_check(quantized, opts.tp)  # CheckError stops eval here
    timings["format_check"] = time.perf_counter() - t0

    dev = resolve_device(opts.device)
    t = time.perf_counter()
    kw: dict[str, Any] = {"device": dev, "dtype": opts.dtype, "backend": opts.backend}
    if opts.kernels is not None:
        kw["kernels"] = opts.kernels
    try:
        activations = resolve_activations(opts.activations, qfmt)
    except ValueError as exc:
        raise EvalInputError(f"--activations {opts.activations}: {quantized}: {exc}") from None
    ref_model = load(reference, **kw)
    q_model = load(quantized, **kw, activations=activations)
    use_kv_cache_dtype(q_model, opts.kv_cache)
    timings["load"] = time.perf_counter() - t

    result: dict[str, Any] = {
        "salaquant": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(dev),
        "quantized": {
            "path": str(quantized),
            "format": qfmt,
            "activations": activations,
            "kv_cache": opts.kv_cache,
            "check": check,
        },
        "reference": {"path": str(reference), "format": rfmt},
        "settings": {
            **{k: v for k, v in dataclasses.asdict(opts).items() if k not in ("show_progress", "prompts")},
            "niah_lengths": niah_lengths,
            "dense_len": qcfg.dense_len,
            "unk_token_id": unk_id,
            "eos_token_id": eos_id,
        },
        "data": {
            **text.summary(),
            "window_len": opts.max_len,
            "attention": opts.attention,
            "effective_attention": nh.effective_attention(opts.attention, opts.max_len, qcfg.dense_len),
        },
        "notes": notes,
    }

    pair = ModelPair(ref_model, q_model, opts.attention, dev)
    with Phases(opts.show_progress) as progress:
        t = time.perf_counter()
        with progress.phase("perplexity / KL", len(wins)) as step:
            cmp, rerun = compare_windows(pair, wins, unk_id=unk_id, rerun_first=True, on_window=step)
        result["perplexity"] = cmp.summary()
        result["stability"] = rerun.summary() if rerun is not None else None
        timings["perplexity"] = time.perf_counter() - t

        both = {"source": ref_model, "quantized": q_model}
        families: tuple[tuple[str, Sequence[Any], str, Any], ...] = (
            ("niah", cases, "needle in a haystack", niah_result),
            ("tasks", task_cases, "long-context tasks", tasks_result),
        )
        runs = []
        for run in range(opts.repeat):
            checks: dict[str, Any] = {}
            for key, built, phase, scored in families:
                t = time.perf_counter()
                checks[key] = None
                if built:
                    queue = [(c.length, c.ids, c.max_new_tokens) for c in built]
                    decoded = _continue_both(both, tokenizer, queue, opts, phase, progress, run)
                    checks[key] = scored(built, decoded, opts, qcfg.dense_len)
                timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            checks["generation"] = _run_generation(
                ref_model, q_model, tokenizer, prompts, opts, eos_id, unk_id, progress, run
            )
            timings["generation"] = timings.get("generation", 0.0) + time.perf_counter() - t
            if run == 0:
                result.update(checks)
            runs.append(run_measures(checks))
        if opts.repeat > 1:
            result["repeats"] = {"runs": runs, "temperature": opts.temperature, "spread": spread(runs)}

        t = time.perf_counter()
        if opts.layer_windows > 0:
            with progress.phase("per-layer error", qcfg.num_hidden_layers) as step:
                errs = lay.layer_errors(pair, wins[: opts.layer_windows], on_layer=step)
            result["layers"] = lay.summarize(errs) | {"windows": min(opts.layer_windows, len(wins))}
        else:
            result["layers"] = None
        timings["layers"] = time.perf_counter() - t

    checks = gates.check(result)
    result["thresholds"] = checks
    result["failures"] = [c["message"] for c in checks if not c["passed"]]
    result["passed"] = not result["failures"]
    name_outliers(result)
    timings["total"] = time.perf_counter() - started
    result["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    if folder is not None:
        result["report"] = {"json": str(folder / report.JSON_NAME), "png": str(folder / report.PNG_NAME)}
        report.write_json(result, folder)
        report.write_png(result, folder)
    report.render(result, console)
    wrote = f"wrote {folder / report.JSON_NAME} and {report.PNG_NAME}, " if folder is not None else ""
    console.print(f"[dim]{wrote}{timings['total']:.1f} s[/]")
    return result


def _draw(opts: EvalOptions, run: int) -> tuple[Sampling | None, int | None]:
    """Sampling and seed of run ``run`` (greedy with ``temperature`` 0); both models draw with the same seed."""
    if opts.temperature == 0:
        return None, None
    return Sampling(temperature=opts.temperature), opts.seed * 1_000_003 + run


def _continue_both(
    models: dict[str, Any],
    tokenizer: Any,
    prompts: Sequence[tuple[int, torch.Tensor, int]],
    opts: EvalOptions,
    phase: str,
    progress: Phases,
    run: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """Greedy continuations of ``(length, ids, max_new_tokens)`` prompts by each model of ``models``, the prompts of
    one length decoded together (each cut to its own ``max_new_tokens``: greedy tokens do not depend on how many
    follow): per model and prompt the decoded text and the first non-finite step."""
    lengths = list(dict.fromkeys(n for n, _, _ in prompts))
    out: dict[str, list[dict[str, Any]]] = {name: [{} for _ in prompts] for name in models}
    draw = _draw(opts, run)
    with progress.phase(phase, len(models) * len(lengths)) as step:
        for name, model in models.items():
            for n in lengths:
                at = [i for i, p in enumerate(prompts) if p[0] == n]
                longest = max(prompts[i][2] for i in at)
                done = gen.continue_batch(model, [prompts[i][1] for i in at], longest, opts.attention, None, *draw)
                for i, g in zip(at, done, strict=True):
                    text = tokenizer.decode(g.tokens[: prompts[i][2]], skip_special_tokens=True)
                    out[name][i] = {"text": text, "nonfinite_step": g.nonfinite_step}
                step()
    return out


def _run_generation(
    ref_model: Any,
    q_model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    opts: EvalOptions,
    eos_id: int | None,
    unk_id: int | None,
    progress: Phases,
    run: int = 0,
) -> dict[str, Any] | None:
    if opts.gen_tokens == 0 or not prompts:
        return None
    draw = _draw(opts, run)
    rows: list[dict[str, Any]] = [{"prompt": prompt} for prompt in prompts]
    ids = [torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long) for prompt in prompts]
    with progress.phase("generation", 2) as step:
        for name, model in (("source", ref_model), ("quantized", q_model)):
            done = gen.continue_batch(model, ids, opts.gen_tokens, opts.attention, eos_id, *draw)
            for row, g in zip(rows, done, strict=True):
                row[name] = gen.check_continuation(g, unk_id) | {
                    "text": tokenizer.decode(g.tokens, skip_special_tokens=False)
                }
            step()
    for row in rows:
        row["first_divergence"] = gen.first_divergence(row["source"]["tokens"], row["quantized"]["tokens"])
    return {
        "max_new_tokens": opts.gen_tokens,
        "prompts": rows,
        "collapsed_source": sum(bool(r["source"]["collapse"]) for r in rows),
        "collapsed_quantized": sum(bool(r["quantized"]["collapse"]) for r in rows),
        "loops_source": sum(r["source"]["loop"] is not None for r in rows),
        "loops_quantized": sum(r["quantized"]["loop"] is not None for r in rows),
        "identical": sum(r["first_divergence"] is None for r in rows),
    }
