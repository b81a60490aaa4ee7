"""Shared protocol of the quality benchmarks on the shipped tiny model: quantize each variant with a command,
read the export back with the project's loader, score it against bf16 on held-out windows, print a table."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from salaquant.calibration.calib_data import CalibOptions
from salaquant.eval.perplexity import compare_models as compare
from salaquant.eval.perplexity import encode_stream, windows
from salaquant.model.loading import load_model
from salaquant.workflow import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")

# a variant: (name, function(output folder, calibration options, quiet console) that writes the export)
Variant = tuple[str, Callable[[Path, CalibOptions, Console], object]]


def run_benchmark(description: str, variants: list[Variant], json_name: str) -> None:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    console = Console()
    tok = load_tokenizer(MODEL)
    texts = [json.loads(line)["text"] for line in (MODEL / "heldout.jsonl").read_text().splitlines()]
    wins = windows(encode_stream(tok, texts, tok.eos_token_id), 1024, args.windows)
    reference = load_model(MODEL)
    results: dict[str, dict[str, float]] = {"bf16": compare(reference, reference, wins)}
    quiet = Console(quiet=True)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    for i, (name, quantize) in enumerate(variants):
        out = args.out / f"variant-{i}"
        t0 = time.perf_counter()
        quantize(out, calib, quiet)
        seconds = time.perf_counter() - t0
        results[name] = {**compare(reference, load_model(out), wins), "quantize_s": round(seconds, 1)}
        console.print(f"{name}: {results[name]}")
    base = results["bf16"]["ppl"]
    table = Table(title=f"sala-tiny, held-out {args.windows} x 1024 tokens (bf16 ppl {base:.3f})")
    for col in ("variant", "ppl", "ppl increase", "KL(bf16||q)", "top-1 agree", "quantize s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, r in results.items():
        cells = (f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / base - 1):+.2f}%", f"{r['kl']:.4f}", f"{100 * r['top1']:.2f}%")
        table.add_row(name, *cells, str(r.get("quantize_s", "")))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"calibration": {"max_samples": args.max_samples, "max_len": args.max_len}, "results": results}
    (args.out / json_name).write_text(json.dumps(summary, indent=2))
