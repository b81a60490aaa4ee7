"""What the studies share: the two texts they score on (a validation text that picks settings, the held-out
windows of ``quality.py`` that confirm them), the bf16 reference's logits on them, per-window figures with standard
errors and paired differences, the state of the sources a run measured, and the plain variant table of the NVFP4
option study.

The studies run as ``python benchmarks/studies/NAME.py`` (this folder on ``sys.path``); this module puts
``benchmarks/`` there too, for ``common``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CALIB, ROOT, TINY, quiet

from salaquant.calibration.calib_data import CalibOptions
from salaquant.eval.data import SHIPPED_SAMPLE, load_eval_text
from salaquant.eval.metrics import LogitComparison
from salaquant.eval.perplexity import compare_models, encode_stream, windows
from salaquant.model.loading import load_model
from salaquant.workflow import load_tokenizer

MODEL = TINY
__all__ = [
    "CALIB",
    "MODEL",
    "ROOT",
    "TextSet",
    "Variant",
    "decide",
    "mean",
    "paired",
    "paired_pooled",
    "quiet",
    "run_benchmark",
    "scoring_arguments",
    "scoring_sets",
    "se",
    "slug",
    "source_state",
    "validation_text",
]

# Files whose edits change the figures: hashed at the start and the end of the run (another change in flight
# to any of them between the two shows up as a mismatch in the JSON).
WATCHED = (
    "salaquant/gptq/solver.py",
    "salaquant/gptq/layer.py",
    "salaquant/formats/gptq_v1/packing.py",
    "salaquant/gptq/command.py",
    "salaquant/calibration/engine.py",
    "salaquant/smooth/fold.py",
    "salaquant/calibration/stats.py",
)


def source_state(watched: tuple[str, ...] = WATCHED) -> dict[str, Any]:
    files = {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:16] for f in watched}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *watched], cwd=ROOT, capture_output=True, text=True
        ).stdout.split("\n")
    except OSError:
        head, dirty = "?", []
    return {"git_head": head, "modified": [line[3:] for line in dirty if line.strip()], "sha256_16": files}


def validation_text(out: Path, tok: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """The records of the model's held-out split that are neither in the shipped held-out sample nor in the
    calibration file, written to ``out/validation.jsonl`` and tokenized the way eval tokenizes held-out text."""
    sample = {json.loads(line)["text"] for line in SHIPPED_SAMPLE.read_text().splitlines() if line.strip()}
    calib = {json.loads(line)["text"] for line in CALIB.read_text().splitlines() if line.strip()}
    kept = []
    for line in (MODEL / "heldout.jsonl").read_text().splitlines():
        if line.strip() and (rec := json.loads(line))["text"] not in sample | calib:
            kept.append(rec)
    path = out / "validation.jsonl"
    path.write_text("".join(json.dumps({"id": r.get("id"), "text": r["text"]}) + "\n" for r in kept))
    text = load_eval_text(str(path), tok, tok.eos_token_id)
    return text.tokens, {**text.summary(), "ids": [r.get("id") for r in kept]}


class TextSet:
    """Windows of one text and the bf16 model's logits on them (computed once, shared by every variant)."""

    def __init__(self, name: str, wins: list[torch.Tensor], reference: torch.nn.Module) -> None:
        self.name, self.wins = name, wins
        with torch.no_grad():
            self.ref_logits = [reference(w[None], attention_mode="dense").logits[0, :-1] for w in wins]

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        """``LogitComparison`` of bf16 against ``model`` over all windows, plus per-window means (the unit of
        the standard errors and of the paired comparisons)."""
        cmp = LogitComparison()
        for w, p in zip(self.wins, self.ref_logits, strict=True):
            cmp.update(p, model(w[None], attention_mode="dense").logits[0, :-1], w[1:])
        s = cmp.summary()
        nll_diff = [float((q - p).double().mean()) for p, q in zip(cmp.source.nll, cmp.quantized.nll, strict=True)]
        kl = [float(k.double().mean()) for k in cmp.kl]
        return {
            "ppl": s["ppl_quantized"],
            "ppl_source": s["ppl_source"],
            "ppl_increase": s["ppl_increase"],
            "ppl_increase_se": math.exp(mean(nll_diff)) * se(nll_diff),  # delta method on exp(mean NLL diff)
            "kl": s["kl"],
            "kl_se": se(kl),
            "kl_p99": s["kl_p99"],
            "top1": s["top1"],
            "windows": s["windows"],
            "tokens": s["tokens"],
            "window_nll_diff": nll_diff,
            "window_kl": kl,
        }


def mean(x: list[float]) -> float:
    return sum(x) / len(x)


def se(x: list[float]) -> float:
    if len(x) < 2:
        return math.nan
    m = mean(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x))


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Variant ``a`` minus variant ``b`` on the same windows: NLL difference (nats/token, ~ ppl-increase
    difference), KL difference, each with its standard error over windows, and the share of windows where
    ``a`` has the lower KL."""
    dn = [x - y for x, y in zip(a["window_nll_diff"], b["window_nll_diff"], strict=True)]
    dk = [x - y for x, y in zip(a["window_kl"], b["window_kl"], strict=True)]
    return {
        "nll": mean(dn),
        "nll_se": se(dn),
        "kl": mean(dk),
        "kl_se": se(dk),
        "kl_windows_better": sum(d < 0 for d in dk) / len(dk),
    }


def paired_pooled(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, float]:
    """Validation KL of ``a`` minus ``b`` over the windows of every export pair (e.g. default and dense-all)."""
    dk = [x - y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra["window_kl"], rb["window_kl"], strict=True)]
    return {"kl": mean(dk), "kl_se": se(dk), "windows_better": sum(d < 0 for d in dk) / len(dk)}


def decide(rows: list[dict[str, Any]], incumbent: str, exports: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The rule of the NVFP4 studies: least mean validation KL over the ``exports`` (each row holds one result per
    export name); it replaces the incumbent only when lower by more than one pooled paired standard error."""
    ok = [r for r in rows if all("validation" in r[ex] for ex, _ in exports)]
    mean_kl = {r["variant"]: mean([r[ex]["validation"]["kl"] for ex, _ in exports]) for r in ok}
    best = min(ok, key=lambda r: mean_kl[r["variant"]])
    inc = next(r for r in ok if r["variant"] == incumbent)
    d = paired_pooled([best[ex]["validation"] for ex, _ in exports], [inc[ex]["validation"] for ex, _ in exports])
    chosen = best if best is not inc and d["kl"] < -d["kl_se"] else inc
    return {"least_kl": best["variant"], "vs_incumbent": d, "chosen": chosen["variant"], "mean_kl": mean_kl}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c == "." else "-" for c in name.lower()).strip("-")


def scoring_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every study on these texts takes: output folder, calibration, windows, threads, resume."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows (quality.py's)")
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--val-windows", type=int, default=None, help="validation windows (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true", help="reuse the scored rows a previous run left in OUT/rows")
    return ap


def scoring_sets(
    args: argparse.Namespace, device: str = "cpu"
) -> tuple[torch.nn.Module, list[TextSet], dict[str, Any]]:
    """The bf16 reference and the ``[validation, heldout]`` sets it is scored against (the held-out windows are
    exactly quality.py's), on ``device``, with the validation text's description."""
    tok = load_tokenizer(MODEL)
    reference = load_model(MODEL, device=device)
    held_tokens = load_eval_text(None, tok, tok.eos_token_id).tokens
    held_windows = [w.to(device) for w in windows(held_tokens, args.window_len, args.windows)]
    held = TextSet("heldout", held_windows, reference)
    val_tokens, val_info = validation_text(args.out, tok)
    val_windows = [w.to(device) for w in windows(val_tokens, args.window_len, args.val_windows)]
    val = TextSet("validation", val_windows, reference)
    return reference, [val, held], val_info


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
    results: dict[str, dict[str, float]] = {"bf16": compare_models(reference, reference, wins)}
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    for i, (name, quantize) in enumerate(variants):
        out = args.out / f"variant-{i}"
        t0 = time.perf_counter()
        quantize(out, calib, quiet())
        seconds = time.perf_counter() - t0
        results[name] = {**compare_models(reference, load_model(out), wins), "quantize_s": round(seconds, 1)}
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
