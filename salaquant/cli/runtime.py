"""The commands that run a checkpoint: ``generate``, ``eval`` and ``demo``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

from ..eval.options import EvalOptions
from ..io.files import CheckpointError
from ..model.config import ConfigError
from .app import app, console, err, fail
from .blocks import Flags, with_blocks
from .options import Device, table_block

_EVAL = EvalOptions()  # every eval flag's default is the option's own


@app.command()
def generate(
    model: Annotated[Path, typer.Argument(help="A bf16, GPTQ or NVFP4 SALA checkpoint folder.")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "The",
    prompts: Annotated[
        Path | None,
        typer.Option(help="A file of prompts (one per line, or JSONL): each continuation is printed as a JSON line."),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together (with --prompts).", min=1)] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 40,
    temperature: Annotated[float, typer.Option(help="0: greedy; above 0: sample at this temperature.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set holding this probability (1: all).")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler (a reproducible completion).")] = None,
    attention: Annotated[str, typer.Option(help="auto (dense below dense_len), dense or sparse.")] = "auto",
    device: Device = "auto",
    backend: Annotated[str, typer.Option(help="auto (Triton on CUDA), triton or reference.")] = "auto",
    attention_kernels: Annotated[
        bool, typer.Option(help="Run GLA / sparse attention with salaquant.kernels (Triton on CUDA).")
    ] = True,
    graphs: Annotated[bool, typer.Option(help="Replay each decode step as a CUDA graph (CUDA only).")] = True,
    compile: Annotated[
        bool,
        typer.Option(
            help="Compile the decode step with torch.compile before capturing it (CUDA graphs only): faster steps "
            "after about a minute of compiling per batch size at the full shape; pays off over long generations."
        ),
    ] = False,
) -> None:
    """Completion with the runtime (greedy unless --temperature): a quick check that a checkpoint loads and talks,
    or, with --prompts, batched generation over a file of prompts."""
    import time

    import torch

    from ..calibration.calib_data import CalibrationError
    from ..devices import resolve_device
    from ..eval.generation import load_prompts
    from ..io.reader import CheckpointReader
    from ..model.config import ATTENTION_MODES
    from ..model.modeling import NonFiniteLogits
    from ..model.sampling import Sampling
    from ..runtime.decode import Decoder
    from ..runtime.load import checkpoint_format, load, open_checked
    from ..workflow import load_tokenizer

    if attention not in ATTENTION_MODES:
        fail(f"--attention {attention!r}: expected one of {', '.join(ATTENTION_MODES)}")
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        dev = resolve_device(device)
        open_checked(model, dev, backend)  # before the tokenizer and the prompts: the checks of check and eval
        tok = load_tokenizer(model)
        texts = [prompt] if prompts is None else load_prompts(prompts, tok)
        net = load(model, device=dev, backend=backend, kernels=attention_kernels)
    except (ValueError, CheckpointError, CalibrationError, RuntimeError, OSError) as exc:
        fail(str(exc))
    ids = [torch.tensor(tok(t)["input_ids"], dtype=torch.long) for t in texts]
    if any(len(i) == 0 for i in ids):
        fail(f"prompt {[len(i) for i in ids].index(0)} has no tokens")
    generator = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    dec = Decoder(net, graphs=graphs, compile=compile, attention_mode=attention)
    eos = tok.eos_token_id
    t0 = time.perf_counter()
    try:
        outs = dec.generate_in_batches(
            ids, max_new_tokens, sampling, batch_size=batch_size, generator=generator, eos_token_id=eos
        )
    except NonFiniteLogits as exc:
        fail(f"{model}: {exc}; no text is printed")
    seconds = time.perf_counter() - t0
    fmt = checkpoint_format(CheckpointReader(model))
    made = sum(len(o) for o in outs)
    err.print(f"[dim]{model} ({fmt}) on {dev}: {made} tokens for {len(ids)} prompt(s) in {seconds:.2f} s[/]")
    if prompts is None:
        sys.stdout.write(prompt + tok.decode(outs[0], skip_special_tokens=True) + "\n")
        return
    for text, out in zip(texts, outs, strict=True):
        completion = tok.decode(out, skip_special_tokens=True)
        sys.stdout.write(json.dumps({"prompt": text, "completion": completion, "tokens": len(out)}) + "\n")


EVAL_FLAGS = (
    ("data", str | None, "Held-out text: .jsonl, text, folder, parquet or hf:NAME... (default: shipped)"),
    ("field", str | None, "Record field holding the text."),
    ("max_len", int, "Tokens per perplexity window (context length)."),
    ("windows", int, "Number of windows scored."),
    ("attention", str, "auto (sparse from dense_len on), dense or sparse."),
    ("gen_tokens", int, "Greedy tokens per prompt (0 skips generation)."),
    ("gen_prompts", int, "Built-in prompts generated from (without --prompts); 16 with --gen-tokens 2048: long runs."),
    ("task_samples", int, "Cases per task and length."),
    ("temperature", float, "NIAH, tasks and generation: 0 greedy, else sampled at this temperature."),
    ("repeat", int, "Runs of NIAH, tasks and generation with different seeds (needs --temperature)."),
    ("kv_cache", str, "The export's minicpm4 KV cache as SGLang stores it: bf16, fp8_e5m2 or fp8_e4m3."),
    ("layer_windows", int, "Windows for the per-layer error (0 skips it)."),
    ("device", str, "auto, cuda, cuda:N or cpu."),
    ("backend", str, "Quantized linears: auto (Triton on CUDA), triton or reference."),
    ("activations", str, "auto (fp4 for NVFP4: W4A4 as Blackwell runs it), fp4 or bf16 (weight-only)."),
    ("tp", int, "Tensor-parallel size for the format check."),
    ("seed", int, "Seed of the NIAH filler, keys and values."),
)
"""The eval flags that are ``EvalOptions`` fields as they stand: ``(field, type, help)``."""
GATE_FLAGS = (
    ("max_ppl_increase", str | None, 'Fail above this perplexity increase: "5%" or 0.05.'),
    ("max_kl", str | None, "Fail above this mean KL(source || quantized), nats/token."),
    ("min_top1", str | None, 'Fail below this top-1 agreement: "90%" or 0.9.'),
    ("max_layer_error", str | None, "Fail when a layer's relative error exceeds this."),
    ("max_niah_drop", str | None, 'Fail when the NIAH exact-match rate drops by more than this ("10%").'),
    ("max_rerun_diff", str | None, "Fail when two runs of the same window differ by more (abs. logit)."),
    ("max_drop", str | None, 'Fail when a task\'s mean score drops by more: "cwe=5%,vt=10%".'),
    ("no_collapse", bool, "Fail on collapse (where the source has none) or NaN/Inf logits.", ("--no-collapse",)),
    ("no_new_loops", bool, "Fail on n-gram loops the source's continuation does not have.", ("--no-new-loops",)),
)
_GATES = SimpleNamespace(**{f[0]: False if f[1] is bool else None for f in GATE_FLAGS})
"""The eval gates, unset by default (a gate is checked only when given)."""


@app.command("eval")
@with_blocks(
    measure=table_block(_EVAL, EVAL_FLAGS),
    gate=table_block(_GATES, GATE_FLAGS),
)
def eval_command(
    *,
    quantized: Annotated[Path, typer.Argument(help="The exported (GPTQ / NVFP4) checkpoint folder.")],
    reference: Annotated[Path, typer.Option("--reference", "-r", help="The bf16 source checkpoint folder.")],
    measure: Flags,
    niah: Annotated[
        str, typer.Option(help='Needle-in-a-haystack lengths, e.g. "8k,32k"; auto = dense_len,4xdense_len; none.')
    ] = "auto",
    niah_depths: Annotated[str, typer.Option(help="Needle depths (fractions of the context).")] = ",".join(
        map(str, _EVAL.niah_depths)
    ),
    prompts: Annotated[
        str | None, typer.Option(help="Generation prompts: .jsonl (prompt/text) or one per line (default: built-in).")
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(help="Long-context tasks: niah_multikey, niah_multivalue (niah: both), vt, cwe, fwe; none."),
    ] = "none",
    lengths: Annotated[
        str, typer.Option(help='Task prompt lengths, e.g. "4k,32k,128k"; auto = the NIAH lengths.')
    ] = "auto",
    report: Annotated[
        Path | None,
        typer.Option(
            help="Write eval.json / eval.png to this folder: a new or empty one, one of earlier reports, or the "
            "evaluated export (default: none, the report is only printed)."
        ),
    ] = None,
    attention_kernels: Annotated[
        bool | None,
        typer.Option(
            "--attention-kernels/--no-attention-kernels", help="GLA / sparse attention kernels (default: runtime's)."
        ),
    ] = None,
    gate: Flags,
) -> None:
    """Quantized vs bf16 source: perplexity, KL, top-1, NIAH, generation checks, per-layer error; gates.

    Exit status: 0 all thresholds met, 1 format check failed, 2 bad input, 3 a threshold missed.
    """
    from ..calibration.calib_data import CalibrationError
    from ..eval import EvalInputError, Thresholds, run_eval
    from ..eval.options import parse_depths, parse_lengths
    from ..eval.tasks import TASKS, parse_tasks
    from ..eval.thresholds import parse_fraction, parse_non_negative, parse_task_drops
    from ..formats.check import CheckError

    try:

        def parsed(key: str, parse: Callable[[str, str], float]) -> float | None:
            value = gate[key]
            return None if value is None else parse(value, "--" + key.replace("_", "-"))

        fractions = {k: parsed(k, parse_fraction) for k in ("max_ppl_increase", "min_top1", "max_niah_drop")}
        numbers = {k: parsed(k, parse_non_negative) for k in ("max_kl", "max_layer_error", "max_rerun_diff")}
        gates = Thresholds(
            **fractions,
            **numbers,
            max_task_drop=parse_task_drops(gate["max_drop"], TASKS) if gate["max_drop"] is not None else None,
            no_collapse=gate["no_collapse"],
            no_new_loops=gate["no_new_loops"],
        )
        options = EvalOptions(
            **measure,
            niah_lengths=parse_lengths(niah),
            niah_depths=parse_depths(niah_depths),
            prompts_file=prompts,
            tasks=parse_tasks(tasks),
            task_lengths=parse_lengths(lengths, "--lengths"),
            kernels=attention_kernels,
        )
        result = run_eval(quantized, reference, options, gates, report, console)
    except CheckError as exc:
        fail(f"format check failed, eval stopped: {exc}", code=1)
    except (EvalInputError, CalibrationError, ConfigError, CheckpointError, ValueError, OSError) as exc:
        fail(str(exc))
    if not result["passed"]:
        fail("eval: " + "; ".join(result["failures"]), code=3)


@app.command()
def demo(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the checkpoints and demo.json (default: a new temp folder)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="Less calibration and evaluation (a smoke run of a few minutes).")
    ] = False,
    model: Annotated[Path | None, typer.Option(help="A bf16 SALA checkpoint (default: the shipped sala-tiny).")] = None,
    calib: Annotated[Path | None, typer.Option(help="Calibration JSONL (default: the shipped sample).")] = None,
    device: Device = "cpu",
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace a folder salaquant wrote for another use (an export); a demo's own is reused."),
    ] = False,
) -> None:
    """Quantize the shipped tiny model with GPTQ W4A16 and NVFP4 (default, dense-all) and score each against bf16."""
    from ..calibration.calib_data import CalibrationError
    from ..demo import DemoError, run_demo

    try:
        run_demo(out, console, quick=quick, model=model, calib=calib, device=device, overwrite=overwrite)
    except (DemoError, CalibrationError, ConfigError, CheckpointError, ValueError, OSError) as exc:
        fail(str(exc))
