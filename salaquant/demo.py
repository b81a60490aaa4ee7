"""``salaquant demo``: the shipped tiny model through every shipped quantizer, then scored against bf16.

Quantizes ``models/sala-tiny`` with the shipped calibration set as GPTQ W4A16 and as NVFP4 (default exclusions
and dense-all), reads each export back with the runtime (packed quantized linears, as served) and compares it
with the bf16 model on held-out text: checkpoint size, perplexity, KL(bf16 || export), top-1 agreement and a
greedy-generation collapse check. Each NVFP4 export is scored twice: W4A4 (its linears' inputs quantized to NVFP4
with the export's input scales, as Blackwell runs it) and weight-only (16-bit activations, as older GPUs do).
One table, ``demo.json`` and the checkpoints under the output folder. ``demo.json`` is written first (no rows yet),
so a stopped demo's folder is still known as the demo's, and rewritten with the table at the end.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from .calibration.calib_data import CalibOptions
from .eval.data import load_eval_text
from .eval.generation import BUILTIN_PROMPTS, check_continuation, greedy
from .eval.metrics import ModelPair, compare_windows
from .eval.perplexity import windows
from .outputs import check_no_overlap, check_replace, check_writable_folder, remove_owned
from .ownership import DEMO, judge
from .progress import Phases
from .workflow import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = REPO_ROOT / "models" / "sala-tiny"
SHIPPED_CALIB = REPO_ROOT / "calib" / "sala-tiny-calib.jsonl"
MARKER = "demo.json"
FOLDERS = ("gptq-w4a16", "nvfp4", "nvfp4-dense-all")  # the exports under the demo's folder


class DemoError(ValueError):
    """Bad demo input (missing shipped files)."""


@dataclass(frozen=True)
class DemoSize:
    """How much calibration and evaluation the demo does."""

    calib_samples: int
    calib_len: int
    eval_windows: int
    eval_len: int
    gen_prompts: int
    gen_tokens: int


FULL = DemoSize(calib_samples=32, calib_len=2048, eval_windows=16, eval_len=1024, gen_prompts=6, gen_tokens=32)
QUICK = DemoSize(calib_samples=8, calib_len=512, eval_windows=4, eval_len=512, gen_prompts=2, gen_tokens=16)


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the tensor files of a checkpoint folder."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def score_export(
    reference: Any,
    quantized: Any,
    wins: list[torch.Tensor],
    prompts: list[torch.Tensor],
    gen_tokens: int,
    unk_id: int | None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Perplexity, KL, top-1 of ``quantized`` against ``reference`` on ``wins`` (dense attention), and whether
    its greedy continuations of ``prompts`` collapse (a flood of the unknown token, one token repeated, NaN)."""
    cmp, _ = compare_windows(ModelPair(reference, quantized, "dense", device), wins, unk_id=unk_id)
    s = cmp.summary()
    problems = []
    for ids in prompts:
        check = check_continuation(greedy(quantized, ids[None].to(device), gen_tokens, "dense"), unk_id)
        if check["collapse"]:
            problems.append(check["collapse"])
        if check["nonfinite_step"] is not None:
            problems.append(f"NaN/Inf logits at step {check['nonfinite_step']}")
    return {
        "ppl": s["ppl_quantized"],
        "ppl_source": s["ppl_source"],
        "ppl_increase": s["ppl_increase"],
        "kl": s["kl"],
        "top1": s["top1"],
        "collapse": problems,
    }


def _resolve(model: Path | None, calib: Path | None) -> tuple[Path, Path]:
    """The model and calibration set: those named by ``--model`` / ``--calib``, else the shipped ones; a path
    that does not exist is refused as what it is (the user's, or a shipped file missing from an installed wheel)."""
    choices = ((model, SHIPPED_MODEL, "model", "--model"), (calib, SHIPPED_CALIB, "calibration set", "--calib"))
    for given, shipped, what, flag in choices:
        if given is not None and not given.exists():
            raise DemoError(f"{flag} {given}: no such file or folder")
        if given is None and not shipped.exists():
            raise DemoError(
                f"the shipped {what} is not at {shipped} (it ships in the source tree, not in the wheel): "
                f"run from a checkout or pass {flag}"
            )
    return model or SHIPPED_MODEL, calib or SHIPPED_CALIB


def _prepare_output(out: Path | None, overwrite: bool, inputs: list[tuple[str, Path]], console: Console) -> Path:
    """The demo's folder: ``out`` (checked like every output) or, when none is named, a new temporary folder. An
    earlier demo's folder is the demo's own and rewritten as it is; another folder salaquant wrote (an export) is
    replaced only with ``--overwrite``; a folder holding files salaquant did not write is refused."""
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="salaquant-demo-"))
        console.print(f"writing the demo's checkpoints under {out} (--out names another folder)")
        return out
    check_no_overlap(out, inputs, flag="--out")
    check_writable_folder(out, flag="--out")
    verdict = judge(out)
    if verdict.foreign or (verdict.kind is not None and verdict.kind.name != DEMO):
        check_replace(out, overwrite, flag="--out")
        remove_owned(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_result(out: Path, result: dict[str, Any]) -> None:
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out / MARKER)


def _variants(
    model: Path, calib: Path, options: CalibOptions, device: str
) -> list[tuple[str, str, Callable[[Path, Console], object]]]:
    from .driver import run_method
    from .gptq.command import GPTQMethod, RunOptions
    from .gptq.layer import GPTQLayerOptions
    from .gptq.plan import BitsOptions
    from .nvfp4.command import NVFP4Method, NVFP4RunOptions
    from .nvfp4.layer import NVFP4LayerOptions

    def gptq(out: Path, console: Console) -> object:
        run = RunOptions(device=device, show_progress=False, overwrite=True)
        return run_method(
            model, out, [str(calib)], options, GPTQMethod(BitsOptions(), GPTQLayerOptions(), run), console
        )

    def nvfp4(dense_all: bool) -> Callable[[Path, Console], object]:
        def quantize(out: Path, console: Console) -> object:
            run = NVFP4RunOptions(dense_all=dense_all, device=device, show_progress=False, overwrite=True)
            return run_method(model, out, [str(calib)], options, NVFP4Method(NVFP4LayerOptions(), run), console)

        return quantize

    return [
        ("GPTQ W4A16", FOLDERS[0], gptq),
        ("NVFP4", FOLDERS[1], nvfp4(False)),
        ("NVFP4 dense-all", FOLDERS[2], nvfp4(True)),
    ]


def run_demo(
    out: Path | None,
    console: Console,
    quick: bool = False,
    model: Path | None = None,
    calib: Path | None = None,
    device: str = "cpu",
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Quantize, score and tabulate; returns what ``demo.json`` holds."""
    from .devices import resolve_device
    from .io.reader import CheckpointReader
    from .runtime.load import checkpoint_format, load, resolve_activations

    model, calib = _resolve(model, calib)
    out = _prepare_output(out, overwrite, [("model", model), ("calibration set", calib)], console)
    _write_result(out, {"rows": []})  # the folder is the demo's from its first file on
    size = QUICK if quick else FULL
    dev = resolve_device(device)
    t_start = time.perf_counter()
    tok = load_tokenizer(model)
    unk_id = tok.unk_token_id
    stream = load_eval_text(None, tok, tok.eos_token_id)
    wins = windows(stream.tokens, size.eval_len, size.eval_windows)
    prompts = [torch.tensor(tok(p)["input_ids"], dtype=torch.long) for p in BUILTIN_PROMPTS[: size.gen_prompts]]
    options = CalibOptions(max_samples=size.calib_samples, max_len=size.calib_len)
    variants = _variants(model, calib, options, str(dev))
    quiet = Console(quiet=True)

    rows: list[dict[str, Any]] = []
    with Phases(show_progress) as progress:
        with progress.phase("bf16 model: load, score", 1) as step:
            reference = load(model, device=dev)
            base = score_export(reference, reference, wins, prompts, size.gen_tokens, unk_id, dev)
            rows.append({"variant": "bf16", "path": str(model), "activations": "bf16", **base})
            rows[-1]["bytes"] = checkpoint_bytes(model)
            step()
        for label, folder, quantize in variants:
            path = out / folder
            with progress.phase(f"{label}: quantize, score", 2) as step:
                t0 = time.perf_counter()
                quantize(path, quiet)
                seconds = time.perf_counter() - t0
                step()
                # an NVFP4 export twice: W4A4 as Blackwell runs it, then weight-only as older GPUs do
                with CheckpointReader(path) as reader:
                    fp4 = resolve_activations("auto", checkpoint_format(reader)) == "fp4"
                runs = [("fp4", " W4A4"), ("bf16", " weight-only")] if fp4 else [("bf16", "")]
                for activations, suffix in runs:
                    exported = load(path, device=dev, activations=activations)
                    scores = score_export(reference, exported, wins, prompts, size.gen_tokens, unk_id, dev)
                    row = {"variant": label + suffix, "path": str(path), "activations": activations, **scores}
                    rows.append({**row, "bytes": checkpoint_bytes(path), "quantize_s": round(seconds, 1)})
                    del exported
                step()
    result = {
        "model": str(model),
        "calibration": {"source": str(calib), "max_samples": size.calib_samples, "max_len": size.calib_len},
        "eval": {
            "data": stream.source,
            "windows": len(wins),
            "window_tokens": size.eval_len,
            "attention": "dense",
            "prompts": len(prompts),
            "gen_tokens": size.gen_tokens,
        },
        "device": str(dev),
        "quick": quick,
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    _write_result(out, result)
    console.print(table(result))
    console.print(f"checkpoints and reports under {out}/ ({MARKER}); {result['seconds']:.0f} s")
    return result


def table(result: dict[str, Any]) -> Table:
    ev = result["eval"]
    title = (
        f"held-out {ev['windows']} x {ev['window_tokens']} tokens, dense attention, {result['device']}\n"
        "GPTQ: full-Hessian GPTQ, MSE scales, int4 g128; NVFP4: sparse-attention blocks kept bf16; dense-all: those\n"
        "too; W4A4: activations in NVFP4 too (Blackwell); weight-only: 16-bit activations (older GPUs)"
    )
    t = Table(title=title)
    for col in ("variant", "size MB", "ppl", "ppl increase", "KL(bf16||q)", "top-1 agree", "collapse check"):
        t.add_column(col, justify="left" if col in ("variant", "collapse check") else "right")
    for r in result["rows"]:
        check = "ok" if not r["collapse"] else "; ".join(sorted(set(r["collapse"])))
        t.add_row(
            r["variant"],
            f"{r['bytes'] / 1e6:.2f}",
            f"{r['ppl']:.3f}",
            f"{100 * r['ppl_increase']:+.2f}%",
            f"{r['kl']:.4f}",
            f"{100 * r['top1']:.2f}%",
            check,
        )
    return t
