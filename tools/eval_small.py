"""sala-small's bf16 figures on ``salaquant eval``'s own cases: NIAH, the RULER-style tasks, held-out perplexity and
greedy loops, scored as eval scores them.

``salaquant eval`` compares an export with its source; this tool runs the source side alone, on the same cases:
``salaquant.eval.niah.make_case`` at eval's default depths and ``salaquant.eval.tasks.make_task_case`` (the eval's
templates, words and filler), decoded greedily by eval's ``continue_batch`` on the runtime's model (``auto``
attention: sparse from ``dense_len`` on) and scored by ``contains_value`` / ``score``. ``--seeds`` and
``--samples`` widen eval's default of seed 0 and two cases per task, so that a rate is not 5 cases; the seed-0
figures are reported apart. Trivial baselines of cwe and fwe: the first distinct words of the list or text.
Held-out perplexity: ``benchmarks/studies/eval_tiny.py``'s figure (16 x 1024 tokens of sala-tiny's held-out split,
dense).
Loops: eval's ``find_loop`` on its built-in prompts' greedy continuations.

  python tools/eval_small.py CKPT --json OUT/eval.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

import salaquant.model.hf  # noqa: F401  (AutoTokenizer reads config.json)
from salaquant.eval import generation as gen
from salaquant.eval import niah as nh
from salaquant.eval import tasks as tk
from salaquant.eval.options import DEFAULT_DEPTHS
from salaquant.eval.perplexity import encode_stream, perplexity
from salaquant.runtime.load import load


def decode_all(model: Any, tok: Any, prompts: Sequence[torch.Tensor], news: Sequence[int], batch: int) -> list[str]:
    """Greedy continuations, ``batch`` prompts of one length at a time, each cut to its own token count."""
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        part, want = prompts[i : i + batch], news[i : i + batch]
        done = gen.continue_batch(model, list(part), max(want), "auto")
        out += [tok.decode(g.tokens[:n], skip_special_tokens=True) for g, n in zip(done, want, strict=True)]
    return out


def first_distinct_words(text: str, n: int) -> list[str]:
    words = re.findall(r"[a-z]+", text.lower())
    return list(dict.fromkeys(words))[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--niah", default="4096,16384")
    ap.add_argument("--seeds", type=int, default=4, help="NIAH seeds 0..N-1 (eval's default: seed 0)")
    ap.add_argument("--tasks", default="niah_multikey,niah_multivalue,vt,cwe,fwe")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--samples", type=int, default=20, help="cases per task and length (eval's default: 2)")
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--gen-prompts", type=int, default=6)
    ap.add_argument("--heldout", type=Path, default=Path("models/sala-tiny/heldout.jsonl"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = load(args.checkpoint, device=dev)
    bos = tok.bos_token_id
    res: dict[str, Any] = {"checkpoint": str(args.checkpoint), "dense_len": model.config.dense_len}

    rows = []
    for n in (int(x) for x in args.niah.split(",") if x):
        cases = [nh.make_case(tok, n, d, s, bos) for s in range(args.seeds) for d in DEFAULT_DEPTHS]
        texts = decode_all(model, tok, [c.ids for c in cases], [c.max_new_tokens for c in cases], args.batch)
        hits = [nh.contains_value(t, c.value) for t, c in zip(texts, cases, strict=True)]
        seed0 = hits[: len(DEFAULT_DEPTHS)]
        examples = [{"value": c.value, "text": t} for c, t in zip(cases[:3], texts[:3], strict=True)]
        rows.append(
            {
                "length": n,
                "attention": nh.effective_attention("auto", n, model.config.dense_len),
                "rate": sum(hits) / len(hits),
                "cases": len(hits),
                "seed0_rate": sum(seed0) / len(seed0),
                "examples": examples,
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "examples"}), flush=True)
    res["niah"] = rows

    task_rows = []
    for task in (t for t in args.tasks.split(",") if t):
        for n in (int(x) for x in args.lengths.split(",") if x):
            cases = [tk.make_task_case(tok, task, n, i, 0, bos) for i in range(args.samples)]
            texts = decode_all(model, tok, [c.ids for c in cases], [c.max_new_tokens for c in cases], args.batch)
            scores = [tk.score(t, c.answers) for t, c in zip(texts, cases, strict=True)]
            row: dict[str, Any] = {"task": task, "length": n, "score": sum(scores) / len(scores),
                                   "seed0_first2": sum(scores[:2]) / 2, "cases": len(scores)}  # fmt: skip
            if task in ("cwe", "fwe"):
                base = []
                for c in cases:
                    body = tok.decode(c.ids.tolist(), skip_special_tokens=True).split("Question:")[0]
                    body = body.split("often.", 1)[-1] if task == "cwe" else body.split("coded word.", 1)[-1]
                    base.append(tk.score(", ".join(first_distinct_words(body, len(c.answers))), c.answers))
                row["baseline_first_distinct"] = sum(base) / len(base)
            row["examples"] = [{"answers": c.answers, "text": t} for c, t in zip(cases[:2], texts[:2], strict=True)]
            task_rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "examples"}), flush=True)
    res["tasks"] = task_rows

    texts = [json.loads(line)["text"] for line in args.heldout.read_text().splitlines()]
    stream = encode_stream(tok, texts, tok.eos_token_id)
    with torch.no_grad():
        ppl = perplexity(lambda ids: model(ids, attention_mode="dense").logits, stream, 1024, 16, 8, dev)
    res["heldout_ppl_16x1024_dense"] = ppl.perplexity
    print(f"held-out perplexity 16 x 1024 dense: {ppl.perplexity:.3f}", flush=True)

    prompts = [tok(p, return_tensors="pt").input_ids[0] for p in gen.BUILTIN_PROMPTS[: args.gen_prompts]]
    done = gen.continue_batch(model.to(dev), [p.to(dev) for p in prompts], args.gen_tokens, "auto")
    loops = [gen.find_loop(g.tokens) for g in done]
    res["generation"] = {
        "prompts": len(prompts),
        "tokens": args.gen_tokens,
        "looping": sum(lp is not None for lp in loops),
        "samples": [tok.decode(g.tokens[:60], skip_special_tokens=True) for g in done],
        "loops": [lp.summary() if lp else None for lp in loops],
    }
    print(f"looping continuations: {res['generation']['looping']} of {len(prompts)}", flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
