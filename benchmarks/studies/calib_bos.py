"""Whether calibration samples begin with BOS, on the two shipped models: GPTQ W4A16 calibrated with and without
the tokenizer's BOS, against round to nearest, scored on two layouts of the same text.

sala-tiny trained on text streams without BOS; sala-small trained its language-modelling rows without BOS and its
long-context task rows with it (``tools/train_small.py``), so on sala-small BOS selects a mode. The calibration
engine begins every sample with BOS unless ``--no-bos``; eval's perplexity windows are cut from a BOS-less stream.
Each export is scored on the model's held-out documents that are in neither the shipped held-out sample nor the
calibration file (``scoring.validation_text``), as

* **stream windows**: 1,024-token windows of the BOS-less stream, as ``salaquant eval`` cuts them;
* **BOS + document**: each document's first 1,023 tokens after BOS, as a served prompt begins.

Figures: the perplexity change and mean per-token KL(bf16 || quantized) of ``scoring.TextSet`` (standard error over
windows). Calibration: the shipped set, 32 samples of at most 2,048 tokens (the other studies' set). Per linear of
each model, the relative output error of GPTQ (default) over RTN's on the bf16 model's own inputs in each layout,
and the effective rank (``(sum l)^2 / sum l^2`` of the eigenvalues) of those inputs' Gram matrix.
An export already in ``OUT/exports`` is reused.

  python benchmarks/studies/calib_bos.py --out OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from scoring import CALIB, ROOT, TextSet, quiet, scoring_arguments, validation_text

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.eval.perplexity import windows
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.loading import load_model
from salaquant.workflow import load_tokenizer

MODELS = {"sala-tiny": ROOT / "models" / "sala-tiny", "sala-small": ROOT / "models" / "sala-small"}
VARIANTS = (  # (name, layer options, calibration samples begin with BOS)
    ("RTN", GPTQLayerOptions(method="rtn"), True),
    ("GPTQ, BOS (default)", GPTQLayerOptions(), True),
    ("GPTQ, --no-bos", GPTQLayerOptions(), False),
)


def text_sets(model: Path, out: Path, n: int, length: int) -> list[TextSet]:
    tok = load_tokenizer(model)
    reference = load_model(model)
    stream, _ = validation_text(out, tok)
    docs = [json.loads(line)["text"] for line in (out / "validation.jsonl").read_text().splitlines()]
    starts = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]][:length] for t in docs]
    starts = [torch.tensor(s) for s in starts if len(s) == length][:n]
    return [
        TextSet("stream windows", windows(stream, length, n), reference),
        TextSet("BOS + document", starts, reference),
    ]


@torch.no_grad()
def linear_errors(model: Path, gptq: Path, rtn: Path, wins: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per linear: ``|X (W_gptq - W)^T|^2 / |X (W_rtn - W)^T|^2`` with X the bf16 model's inputs over ``wins``,
    and the effective rank of X^T X."""
    ref, g, r = (load_model(p).float() for p in (model, gptq, rtn))
    grams: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}

    def hook(name: str):
        def f(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            grams[name] = grams.get(name, 0) + x.T @ x

        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    for w in wins:
        ref(w[None], attention_mode="dense")
    for h in handles:
        h.remove()
    gm, rm = dict(g.named_modules()), dict(r.named_modules())
    out = {}
    for n, m in linears.items():
        h, w = grams[n], m.weight.double()
        err = [float(torch.trace(d @ h @ d.T)) for d in (gm[n].weight.double() - w, rm[n].weight.double() - w)]
        if err[1] == 0:  # kept in 16 bits by both exports
            continue
        ev = torch.linalg.eigvalsh(h).clamp_min(0)
        out[n] = {"gptq_over_rtn": err[0] / err[1], "effective_rank": float(ev.sum() ** 2 / (ev**2).sum())}
    return out


def main() -> None:
    ap = scoring_arguments(__doc__)
    ap.set_defaults(val_windows=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_name, model in MODELS.items():
        sets = text_sets(model, args.out, args.val_windows, args.window_len)
        for name, opts, bos in VARIANTS:
            export = args.out / "exports" / f"{model_name}-{name.split(',')[0].lower()}-{'bos' if bos else 'nobos'}"
            calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len, bos=bos)
            t0 = time.perf_counter()
            if not (export / "config.json").exists():
                run_method(
                    model,
                    export,
                    [str(CALIB)],
                    calib,
                    GPTQMethod(BitsOptions(), opts, RunOptions(device="cpu", show_progress=False, overwrite=True)),
                    quiet(),
                )
            net = load_model(export)
            row = {"model": model_name, "variant": name, "bos": bos, "seconds": round(time.perf_counter() - t0, 1)}
            row.update({s.name: {k: v for k, v in s.score(net).items() if not k.startswith("window_")} for s in sets})
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("model", "variant", "seconds")}), flush=True)
        ex = args.out / "exports"
        for s in sets:
            errs = linear_errors(model, ex / f"{model_name}-gptq-bos", ex / f"{model_name}-rtn-bos", s.wins)
            rows.append({"model": model_name, "layout": s.name, "linears": errs})
            for layer in sorted({int(n.split(".")[2]) for n in errs}):
                mine = {n.split(".", 3)[3]: e for n, e in errs.items() if int(n.split(".")[2]) == layer}
                ratios = [e["gptq_over_rtn"] for e in mine.values()]
                ranks = ", ".join(f"{k} {e['effective_rank']:.1f}" for k, e in mine.items() if "o_proj" in k)
                print(f"{model_name} {s.name} layer {layer}: GPTQ/RTN error {min(ratios):.2f}-{max(ratios):.2f}; "
                      f"effective rank of the inputs of {ranks}")  # fmt: skip
    head = "| model | variant | stream: ppl / KL | BOS + document: ppl / KL |\n|---|---|---|---|"
    lines = [head]
    for r in rows:
        if "variant" not in r:
            continue
        cells = [
            f"{100 * r[s]['ppl_increase']:+.2f}% / {r[s]['kl']:.4f} +- {r[s]['kl_se']:.4f}"
            for s in ("stream windows", "BOS + document")
        ]
        lines.append(f"| {r['model']} | {r['variant']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    (args.out / "calib_bos.json").write_text(json.dumps({"rows": rows, "settings": vars(args)}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
