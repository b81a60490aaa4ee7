"""The commands that run a checkpoint: ``generate``, ``eval`` and ``demo``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..eval.options import EvalOptions
from ..io.files import CheckpointError
from ..model.config import ConfigError
from .app import app, console, err, fail
from .options import (
    Device,
    Field,
)

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


@app.command("eval")
def eval_command(
    quantized: Annotated[Path, typer.Argument(help="The exported (GPTQ / NVFP4) checkpoint folder.")],
    reference: Annotated[Path, typer.Option("--reference", "-r", help="The bf16 source checkpoint folder.")],
    data: Annotated[
        str | None, typer.Option(help="Held-out text: .jsonl, text, folder, parquet or hf:NAME... (default: shipped)")
    ] = None,
    field: Field = None,
    max_len: Annotated[int, typer.Option(help="Tokens per perplexity window (context length).")] = _EVAL.max_len,
    windows: Annotated[int, typer.Option(help="Number of windows scored.")] = _EVAL.windows,
    attention: Annotated[str, typer.Option(help="auto (sparse from dense_len on), dense or sparse.")] = _EVAL.attention,
    niah: Annotated[
        str, typer.Option(help='Needle-in-a-haystack lengths, e.g. "8k,32k"; auto = dense_len,4xdense_len; none.')
    ] = "auto",
    niah_depths: Annotated[str, typer.Option(help="Needle depths (fractions of the context).")] = ",".join(
        map(str, _EVAL.niah_depths)
    ),
    prompts: Annotated[
        str | None, typer.Option(help="Generation prompts: .jsonl (prompt/text) or one per line (default: built-in).")
    ] = None,
    gen_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt (0 skips generation).")] = _EVAL.gen_tokens,
    gen_prompts: Annotated[
        int,
        typer.Option(help="Built-in prompts generated from (without --prompts); 16 with --gen-tokens 2048: long runs."),
    ] = _EVAL.gen_prompts,
    tasks: Annotated[
        str,
        typer.Option(help="Long-context tasks: niah_multikey, niah_multivalue (niah: both), vt, cwe, fwe; none."),
    ] = "none",
    lengths: Annotated[
        str, typer.Option(help='Task prompt lengths, e.g. "4k,32k,128k"; auto = the NIAH lengths.')
    ] = "auto",
    task_samples: Annotated[int, typer.Option(help="Cases per task and length.")] = _EVAL.task_samples,
    temperature: Annotated[
        float, typer.Option(help="NIAH, tasks and generation: 0 greedy, else sampled at this temperature.")
    ] = _EVAL.temperature,
    repeat: Annotated[
        int, typer.Option(help="Runs of NIAH, tasks and generation with different seeds (needs --temperature).")
    ] = _EVAL.repeat,
    kv_cache: Annotated[
        str, typer.Option(help="The export's minicpm4 KV cache as SGLang stores it: bf16, fp8_e5m2 or fp8_e4m3.")
    ] = _EVAL.kv_cache,
    layer_windows: Annotated[
        int, typer.Option(help="Windows for the per-layer error (0 skips it).")
    ] = _EVAL.layer_windows,
    report: Annotated[
        Path | None,
        typer.Option(
            help="Write eval.json / eval.png to this folder: a new or empty one, one of earlier reports, or the "
            "evaluated export (default: none, the report is only printed)."
        ),
    ] = None,
    device: Device = "auto",
    backend: Annotated[str, typer.Option(help="Quantized linears: auto (Triton on CUDA), triton or reference.")] = (
        "auto"
    ),
    attention_kernels: Annotated[
        bool | None,
        typer.Option(
            "--attention-kernels/--no-attention-kernels", help="GLA / sparse attention kernels (default: runtime's)."
        ),
    ] = None,
    activations: Annotated[
        str, typer.Option(help="auto (fp4 for NVFP4: W4A4 as Blackwell runs it), fp4 or bf16 (weight-only).")
    ] = _EVAL.activations,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size for the format check.")] = _EVAL.tp,
    seed: Annotated[int, typer.Option(help="Seed of the NIAH filler, keys and values.")] = _EVAL.seed,
    max_ppl_increase: Annotated[str | None, typer.Option(help='Fail above this perplexity increase: "5%" or 0.05.')] = (
        None
    ),
    max_kl: Annotated[
        str | None, typer.Option(help="Fail above this mean KL(source || quantized), nats/token.")
    ] = None,
    min_top1: Annotated[str | None, typer.Option(help='Fail below this top-1 agreement: "90%" or 0.9.')] = None,
    max_layer_error: Annotated[
        str | None, typer.Option(help="Fail when a layer's relative error exceeds this.")
    ] = None,
    max_niah_drop: Annotated[
        str | None, typer.Option(help='Fail when the NIAH exact-match rate drops by more than this ("10%").')
    ] = None,
    max_rerun_diff: Annotated[
        str | None, typer.Option(help="Fail when two runs of the same window differ by more (abs. logit).")
    ] = None,
    max_drop: Annotated[
        str | None, typer.Option(help='Fail when a task\'s mean score drops by more: "cwe=5%,vt=10%".')
    ] = None,
    no_collapse: Annotated[
        bool, typer.Option("--no-collapse", help="Fail on collapse (where the source has none) or NaN/Inf logits.")
    ] = False,
    no_new_loops: Annotated[
        bool, typer.Option("--no-new-loops", help="Fail on n-gram loops the source's continuation does not have.")
    ] = False,
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

        def frac(value: str | None, name: str) -> float | None:
            return None if value is None else parse_fraction(value, name)

        def number(value: str | None, name: str) -> float | None:
            return None if value is None else parse_non_negative(value, name)

        gates = Thresholds(
            max_ppl_increase=frac(max_ppl_increase, "--max-ppl-increase"),
            max_kl=number(max_kl, "--max-kl"),
            min_top1=frac(min_top1, "--min-top1"),
            max_layer_error=number(max_layer_error, "--max-layer-error"),
            max_niah_drop=frac(max_niah_drop, "--max-niah-drop"),
            max_rerun_diff=number(max_rerun_diff, "--max-rerun-diff"),
            max_task_drop=parse_task_drops(max_drop, TASKS) if max_drop is not None else None,
            no_collapse=no_collapse,
            no_new_loops=no_new_loops,
        )
        options = EvalOptions(
            data=data,
            field=field,
            max_len=max_len,
            windows=windows,
            attention=attention,
            niah_lengths=parse_lengths(niah),
            niah_depths=parse_depths(niah_depths),
            prompts_file=prompts,
            gen_prompts=gen_prompts,
            tasks=parse_tasks(tasks),
            task_lengths=parse_lengths(lengths, "--lengths"),
            task_samples=task_samples,
            kv_cache=kv_cache,
            temperature=temperature,
            repeat=repeat,
            gen_tokens=gen_tokens,
            layer_windows=layer_windows,
            device=device,
            backend=backend,
            kernels=attention_kernels,
            activations=activations,
            tp=tp,
            seed=seed,
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
