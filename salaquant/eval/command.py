"""``run_eval``: format check, then the quantized model against its source on the same inputs, then the gates.

Order of work: every input is validated before any model is loaded (paths, configs, compatibility, options,
data, report folder); the format checker of the export code runs next and a failed check stops eval; then
perplexity / KL / top-1 on the held-out windows (plus a rerun of the first window), NIAH, greedy generation,
per-layer errors; the thresholds; the report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..io.reader import CheckpointReader
from ..kernels.backend import check_backend
from ..model.config import ATTENTION_MODES, SalaConfig
from ..model.kv_cache_dtype import KV_CACHE_DTYPES, use_kv_cache_dtype
from ..model.sampling import Sampling
from ..ownership import CHECKPOINT, EVAL_REPORT, judge
from ..progress import Phases
from ..runtime.load import ACTIVATIONS
from . import generation as gen
from . import layers as lay
from . import niah as nh
from . import report
from . import tasks as tk
from .data import load_eval_text
from .metrics import compare_windows
from .perplexity import windows as make_windows
from .thresholds import Thresholds

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class EvalInputError(ValueError):
    """Bad input to eval (path, config, option, data): nothing was loaded or run."""


@dataclass
class EvalOptions:
    """What to measure and how. ``niah_lengths=None`` means "auto": dense_len and 4 x dense_len (none when the
    checkpoint has no sparse_config); an empty list skips NIAH; ``gen_tokens=0`` skips generation and
    ``layer_windows=0`` the per-layer error."""

    data: str | None = None
    field: str | None = None
    max_len: int = 4096
    windows: int = 8
    attention: str = "auto"
    niah_lengths: list[int] | None = None
    niah_depths: tuple[float, ...] = DEFAULT_DEPTHS
    prompts: list[str] | None = None  # None: the built-in prompt set
    prompts_file: str | None = None
    gen_prompts: int = gen.DEFAULT_GEN_PROMPTS  # how many built-in prompts (without prompts / prompts_file)
    tasks: list[str] = dataclasses.field(default_factory=list)  # long-context tasks (``tasks.TASKS``); none by default
    task_lengths: list[int] | None = None  # None: the NIAH default lengths
    task_samples: int = 2  # cases per task and length
    temperature: float = 0.0  # NIAH, tasks and generation: 0 greedy, else sampled
    repeat: int = 1  # runs of NIAH, tasks and generation with different sampling seeds (needs temperature > 0)
    kv_cache: str = "bf16"  # the export's minicpm4 KV cache as served (``model.kv_cache_dtype``); the source's stays
    gen_tokens: int = 40
    layer_windows: int = 2
    device: str = "auto"
    backend: str = "auto"
    kernels: bool | None = None  # None: the runtime's default
    activations: str = "auto"  # "auto": FP4 for NVFP4 exports (W4A4, as Blackwell runs them), else 16-bit
    dtype: str = "bf16"
    tp: int = 1
    seed: int = 0
    show_progress: bool = True

    def validate(self) -> None:
        if self.activations not in ("auto", *ACTIVATIONS):
            raise EvalInputError(f"--activations {self.activations!r}: expected auto, {' or '.join(ACTIVATIONS)}")
        if self.attention not in ATTENTION_MODES:
            raise EvalInputError(f"--attention {self.attention!r}: expected one of {', '.join(ATTENTION_MODES)}")
        if self.max_len < 2:
            raise EvalInputError(f"--max-len {self.max_len}: need at least 2 tokens per window")
        if self.windows < 1:
            raise EvalInputError(f"--windows {self.windows}: need at least one window")
        if not 1 <= self.gen_prompts <= len(gen.BUILTIN_PROMPTS):
            raise EvalInputError(f"--gen-prompts {self.gen_prompts}: between 1 and {len(gen.BUILTIN_PROMPTS)}")
        if self.gen_tokens < 0 or 0 < self.gen_tokens < 8:
            raise EvalInputError(f"--gen-tokens {self.gen_tokens}: 0 (skip generation) or at least 8")
        if self.layer_windows < 0:
            raise EvalInputError(f"--layer-windows {self.layer_windows}: must be >= 0")
        if self.tp < 1:
            raise EvalInputError(f"--tp {self.tp}: must be >= 1")
        for d in self.niah_depths:
            if not 0.0 <= d <= 1.0:
                raise EvalInputError(f"--niah-depths: {d} is not a fraction between 0 and 1")
        if self.niah_lengths is not None and any(n < 2 for n in self.niah_lengths):
            raise EvalInputError(f"--niah: lengths must be at least 2 tokens, got {self.niah_lengths}")
        unknown = [t for t in self.tasks if t not in tk.TASKS]
        if unknown:
            raise EvalInputError(f"--tasks: unknown task {unknown[0]!r}; expected {', '.join(tk.TASKS)} (or niah)")
        if not self.temperature >= 0:
            raise EvalInputError(f"--temperature {self.temperature}: must be >= 0")
        if self.repeat < 1:
            raise EvalInputError(f"--repeat {self.repeat}: must be >= 1")
        if self.repeat > 1 and self.temperature == 0:
            raise EvalInputError(f"--repeat {self.repeat} needs --temperature > 0 (greedy runs are all the same)")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise EvalInputError(f"--kv-cache {self.kv_cache!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.task_samples < 1:
            raise EvalInputError(f"--task-samples {self.task_samples}: must be >= 1")
        if self.task_lengths is not None and any(n < 2 for n in self.task_lengths):
            raise EvalInputError(f"--lengths: lengths must be at least 2 tokens, got {self.task_lengths}")
        if self.prompts is not None and any(not p for p in self.prompts):
            raise EvalInputError("--prompts: empty prompt")


# ------------------------------------------------------------------------------------------------ inputs

COMPARED_FIELDS = tuple(f.name for f in dataclasses.fields(SalaConfig) if f.name != "raw")


def _config(path: Path, what: str) -> tuple[SalaConfig, CheckpointReader]:
    if not path.exists():
        raise EvalInputError(f"{what} {path}: no such folder")
    if not path.is_dir():
        raise EvalInputError(f"{what} {path}: not a folder (pass the checkpoint folder)")
    config = SalaConfig.from_file(path)  # ConfigError naming the key of a non-SALA config
    return config, CheckpointReader(path)  # CheckpointError when the weights are missing


def compatibility_problems(quantized: SalaConfig, reference: SalaConfig) -> list[str]:
    """Architecture fields of the two configs that differ (an export keeps every one of them)."""
    return [
        f"{name}: {getattr(quantized, name)!r} in the quantized checkpoint, {getattr(reference, name)!r} in the source"
        for name in COMPARED_FIELDS
        if getattr(quantized, name) != getattr(reference, name)
    ]


def parse_lengths(text: str, flag: str = "--niah") -> list[int] | None:
    """``"8k,32k"`` -> [8192, 32768]; ``"auto"`` -> None; ``"none"`` / ``""`` -> []."""
    t = text.strip().lower()
    if t == "auto":
        return None
    if t in ("", "none", "off", "0"):
        return []
    out = []
    for part in t.split(","):
        p = part.strip()
        mult = 1024 if p.endswith("k") else 1024 * 1024 if p.endswith("m") else 1
        num = p[:-1] if mult > 1 else p
        try:
            value = float(num) * mult
        except ValueError:
            raise EvalInputError(f"{flag} {text!r}: {part!r} is not a length such as 8k, 32k or 4096") from None
        if value != int(value) or value < 2:
            raise EvalInputError(f"{flag} {text!r}: {part!r} is not a whole number of tokens >= 2")
        out.append(int(value))
    return out


def parse_depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise EvalInputError(f"--niah-depths {text!r}: expected fractions such as 0.1,0.5,0.9") from None
    if not depths:
        raise EvalInputError("--niah-depths: no depth given")
    return depths


def _report_dir(folder: Path, quantized: Path, reference: Path) -> Path:
    """The ``--report`` folder, made if missing: a new or empty folder, one of earlier eval reports, or the evaluated
    export when salaquant wrote it. Refused: the reference checkpoint or a folder inside it (a report never goes into
    the bf16 source), a folder inside the evaluated checkpoint, another salaquant folder, any folder holding files
    salaquant did not write (`salaquant.ownership`)."""
    if folder.exists() and not folder.is_dir():
        raise EvalInputError(f"--report {folder}: exists and is not a folder")
    real, ref, q = (Path(os.path.realpath(p)) for p in (folder, reference, quantized))
    if real.is_relative_to(ref):
        where = "is" if real == ref else "lies inside"
        raise EvalInputError(
            f"--report {folder} {where} the reference checkpoint {reference}: a report never goes into the bf16 "
            "source; pass a folder of its own"
        )
    if real != q and real.is_relative_to(q):
        raise EvalInputError(
            f"--report {folder} lies inside the evaluated checkpoint {quantized}: pass the checkpoint itself or a "
            "folder outside it"
        )
    verdict = judge(folder)
    if verdict.foreign:
        raise EvalInputError(
            f"--report {folder} holds files salaquant did not write ({verdict.few()}): pass a new or empty folder, "
            "one of earlier eval reports, or the evaluated export"
        )
    kind = verdict.kind.name if verdict.kind is not None else None
    if kind not in (None, EVAL_REPORT) and not (kind == CHECKPOINT and real == q):
        raise EvalInputError(
            f"--report {folder} is a {kind} salaquant wrote, not the evaluated checkpoint {quantized}: pass a new or "
            "empty folder, one of earlier eval reports, or the evaluated export"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvalInputError(f"--report {folder}: cannot create it ({exc.strerror or exc})") from exc
    if not os.access(folder, os.W_OK):
        raise EvalInputError(f"--report {folder}: not writable")
    return folder


def _format_check(path: Path, tp: int) -> dict[str, Any]:
    """Run the export code's checker (raises ``CheckError``: eval stops)."""
    from ..formats.check import check_checkpoint

    rep = check_checkpoint(path, tp=tp)
    return {
        "status": "passed",
        "detail": f"{rep.format}, tp={tp}: {len(rep.quantized)} quantized linears, {rep.plain_summary()}",
        "quantized_linears": len(rep.quantized),
        "unquantized_linears": len(rep.unquantized),
        "warnings": rep.warnings,
    }


# ------------------------------------------------------------------------------------------------ progress


# ------------------------------------------------------------------------------------------------ run


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
    qcfg, qreader = _config(quantized, "quantized checkpoint")
    rcfg, rreader = _config(reference, "--reference")
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
        niah_lengths = _auto_niah_lengths(qcfg, quantized, notes)
    _check_positions(opts, niah_lengths, qcfg, quantized)
    _gate_needs(gates, opts, niah_lengths)
    folder = _report_dir(Path(report_dir), quantized, reference) if report_dir is not None else None
    has_tokenizer = any((reference / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    try:
        tokenizer = load_tokenizer(reference if has_tokenizer else quantized)
    except (OSError, ValueError) as exc:
        raise EvalInputError(f"no usable tokenizer in {reference} or {quantized}: {exc}") from exc
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else _first(rcfg.eos_token_id)
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
        check = _format_check(quantized, opts.tp)  # CheckError stops eval here
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

    with Phases(opts.show_progress) as progress:
        t = time.perf_counter()
        with progress.phase("perplexity / KL", len(wins)) as step:
            cmp, rerun = compare_windows(
                ref_model, q_model, wins, opts.attention, dev, unk_id=unk_id, rerun_first=True, on_window=step
            )
        result["perplexity"] = cmp.summary()
        result["stability"] = rerun.summary() if rerun is not None else None
        timings["perplexity"] = time.perf_counter() - t

        both = {"source": ref_model, "quantized": q_model}
        families: tuple[tuple[str, Sequence[Any], str, Any], ...] = (
            ("niah", cases, "needle in a haystack", _niah_result),
            ("tasks", task_cases, "long-context tasks", _tasks_result),
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
            runs.append(_run_measures(checks))
        if opts.repeat > 1:
            result["repeats"] = {"runs": runs, "temperature": opts.temperature, "spread": _spread(runs)}

        t = time.perf_counter()
        if opts.layer_windows > 0:
            with progress.phase("per-layer error", qcfg.num_hidden_layers) as step:
                errs = lay.layer_errors(
                    ref_model, q_model, wins[: opts.layer_windows], opts.attention, dev, on_layer=step
                )
            result["layers"] = lay.summarize(errs) | {"windows": min(opts.layer_windows, len(wins))}
        else:
            result["layers"] = None
        timings["layers"] = time.perf_counter() - t

    checks = gates.check(result)
    result["thresholds"] = checks
    result["failures"] = [c["message"] for c in checks if not c["passed"]]
    result["passed"] = not result["failures"]
    _name_outliers(result)
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


def _first(x: int | list[int] | None) -> int | None:
    return x[0] if isinstance(x, list) and x else x if isinstance(x, int) else None


def _auto_niah_lengths(config: SalaConfig, path: Path, notes: list[str]) -> list[int]:
    """``--niah auto``: dense_len and 4 x dense_len (none without a sparse_config), those the model's positions
    hold; a length left out is noted in the report."""
    if config.dense_len is None:
        return []
    limit = config.max_position_embeddings
    lengths = [config.dense_len, 4 * config.dense_len]
    left_out = [n for n in lengths if n > limit]
    if left_out:
        notes.append(f"--niah auto: {left_out} left out, past max_position_embeddings {limit} of {path}/config.json")
    return [n for n in lengths if n <= limit]


def _check_positions(opts: EvalOptions, niah_lengths: Sequence[int], config: SalaConfig, path: Path) -> None:
    """Refuse a window, NIAH or task length past the model's ``max_position_embeddings`` (the positions it was
    built for), before the tokenizer or a model is loaded: a prompt of 2M tokens asks the attention for terabytes."""
    limit = config.max_position_embeddings
    asked = [("--max-len", [opts.max_len]), ("--niah", niah_lengths), ("--lengths", opts.task_lengths or [])]
    for flag, lengths in asked:
        for n in lengths:
            if n > limit:
                raise EvalInputError(
                    f"{flag} {_tokens(n)}: longer than the model's {limit} positions (max_position_embeddings "
                    f"in {path}/config.json)"
                )


def _tokens(n: int) -> str:
    """``n`` tokens as a length flag takes them (``65536`` -> ``64k``, ``2097152`` -> ``2m``)."""
    for unit, size in (("m", 1024 * 1024), ("k", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _gate_needs(gates: Thresholds, opts: EvalOptions, niah_lengths: Sequence[int]) -> None:
    if gates.max_niah_drop is not None and not niah_lengths:
        raise EvalInputError("--max-niah-drop needs NIAH lengths (--niah), but NIAH is off")
    missing = [t for t in (gates.max_task_drop or {}) if t not in opts.tasks]
    if missing:
        raise EvalInputError(f"--max-drop {missing[0]}=...: the task is not run (add it to --tasks)")
    if gates.no_new_loops and opts.gen_tokens == 0:
        raise EvalInputError("--no-new-loops needs generation, but --gen-tokens is 0")
    if gates.max_layer_error is not None and opts.layer_windows == 0:
        raise EvalInputError("--max-layer-error needs the per-layer error, but --layer-windows is 0")


def _name_outliers(result: dict[str, Any]) -> None:
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


def _run_measures(checks: dict[str, Any]) -> dict[str, float]:
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


def _spread(runs: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """min, max, mean and (population) standard deviation of each measure over the runs."""
    out = {}
    for key in runs[0]:
        xs = [r[key] for r in runs]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        out[key] = {"min": min(xs), "max": max(xs), "mean": mean, "std": std}
    return out


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


def _niah_result(built: Sequence[nh.NiahCase], decoded: dict[str, list[dict[str, Any]]], opts: EvalOptions,
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


def _tasks_result(built: Sequence[tk.TaskCase], decoded: dict[str, list[dict[str, Any]]], opts: EvalOptions,
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
