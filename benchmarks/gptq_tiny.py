"""GPTQ W4A16 variants on the shipped tiny model: held-out perplexity, KL and top-1 agreement vs bf16.

Every variant goes through ``salaquant gptq`` (calibration engine, export, checker); the exported checkpoint
is read back by the project's loader (GPTQ tensors dequantized exactly as the serving kernels do) and
evaluated on the first 16 x 1024 held-out tokens, dense attention, CPU.

  python benchmarks/gptq_tiny.py --out OUT [--max-samples 32 --max-len 2048]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from salaquant.calibration import CalibOptions
from salaquant.gptq.command import RunOptions, run_gptq
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.loading import load_model
from salaquant.perplexity import encode_stream, windows
from salaquant.workflow import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")

VARIANTS: dict[str, GPTQLayerOptions] = {
    "RTN w4 g128": GPTQLayerOptions(method="rtn", smooth_alpha=None),
    "GPTQ w4 g128, no smoothing": GPTQLayerOptions(smooth_alpha=None),
    "GPTQ w4 g128, SmoothQuant 0.5 (default)": GPTQLayerOptions(),
    "GPTQ w4 g128, SmoothQuant 0.5, act-order": GPTQLayerOptions(act_order=True),
    "GPTQ w4 g128, SmoothQuant 0.5, MSE scales": GPTQLayerOptions(mse=True),
}


@torch.no_grad()
def compare(reference, model, wins: list[torch.Tensor]) -> dict[str, float]:
    nll = kl = agree = 0.0
    count = 0
    for w in wins:
        ids = w[None]
        p = torch.log_softmax(reference(ids, attention_mode="dense").logits[0, :-1], -1)
        q = torch.log_softmax(model(ids, attention_mode="dense").logits[0, :-1], -1)
        target = ids[0, 1:]
        nll += float(-q.gather(-1, target[:, None]).sum())
        kl += float((p.exp() * (p - q)).sum())
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        count += target.numel()
    return {"ppl": float(torch.exp(torch.tensor(nll / count))), "kl": kl / count, "top1": agree / count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    for name, opts in VARIANTS.items():
        out = args.out / name.split(",")[0].replace(" ", "-").lower() / str(len(results))
        t0 = time.perf_counter()
        run_gptq(
            MODEL,
            out,
            [CALIB],
            CalibOptions(max_samples=args.max_samples, max_len=args.max_len),
            BitsOptions(),
            opts,
            RunOptions(device="cpu", show_progress=False, overwrite=True),
            quiet,
        )
        seconds = time.perf_counter() - t0
        results[name] = {**compare(reference, load_model(out), wins), "quantize_s": round(seconds, 1)}
        console.print(f"{name}: {results[name]}")
    base = results["bf16"]["ppl"]
    table = Table(title=f"sala-tiny, held-out {args.windows} x 1024 tokens (bf16 ppl {base:.3f})")
    for col in ("variant", "ppl", "ppl increase", "KL(bf16||q)", "top-1 agree", "quantize s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['ppl']:.3f}",
            f"{100 * (r['ppl'] / base - 1):+.2f}%",
            f"{r['kl']:.4f}",
            f"{100 * r['top1']:.2f}%",
            str(r.get("quantize_s", "")),
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gptq_tiny.json").write_text(
        json.dumps(
            {"calibration": {"max_samples": args.max_samples, "max_len": args.max_len}, "results": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
