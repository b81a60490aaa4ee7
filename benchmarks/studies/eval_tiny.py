"""Held-out perplexity and greedy samples of the shipped tiny model on the CPU (the README figures).

python benchmarks/studies/eval_tiny.py [--model models/sala-tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

import salaquant.model.hf  # noqa: F401  (AutoTokenizer reads config.json)
from salaquant.eval.perplexity import encode_stream, perplexity
from salaquant.model.loading import load_model

PROMPTS = ["It is a truth universally acknowledged, that", "The king of Assyria", "Call me Ishmael."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/sala-tiny"))
    ap.add_argument("--windows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = [json.loads(line)["text"] for line in (args.model / "heldout.jsonl").read_text().splitlines()]
    stream = encode_stream(tok, texts, tok.eos_token_id)
    model = load_model(args.model)  # bf16, as shipped
    res: dict[str, object] = {"heldout_tokens": stream.numel()}
    for seq_len, mode in ((1024, "dense"), (2048, "dense"), (2048, "sparse")):
        r = perplexity(lambda ids, m=mode: model(ids, attention_mode=m).logits, stream, seq_len, args.windows)
        res[f"ppl_{mode}_{seq_len}"] = round(r.perplexity, 3)
        print(f"held-out perplexity, {r.windows} x {seq_len} tokens, {mode}: {r.perplexity:.3f}")
    unigram = torch.bincount(stream, minlength=model.config.vocab_size).float()
    p = unigram / unigram.sum()
    res["unigram_ppl"] = round(float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum())), 1)
    print(f"unigram perplexity of the same text (entropy of its token distribution): {res['unigram_ppl']}")
    samples = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.greedy(ids, max_new_tokens=40)
        samples[prompt] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"{prompt!r} -> {samples[prompt]!r}")
    res["samples"] = samples
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
