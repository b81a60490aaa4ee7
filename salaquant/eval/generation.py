"""Greedy continuations and what is checked on them.

* **collapse**: the continuation is a flood of the unknown token (at least ``UNK_FRACTION`` of it) or holds a run
  of one token repeated ``COLLAPSE_RUN`` times (the whole continuation when it is shorter);
* **n-gram loop**: a stretch in which a block of ``p`` tokens (1 <= p <= ``LOOP_MAX_PERIOD``) repeats at least
  ``LOOP_MIN_REPEATS`` times back to back, at least ``LOOP_MIN_TOKENS`` tokens long (the smallest such period is
  reported);
* **non-finite**: a NaN or Inf in any logit of the prefill or of a decode step;
* **first divergence**: the first generated position where the quantized model's token differs from the source's.

Decoding stops after the EOS token (which is kept) or ``max_new_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.sampling import Sampling

COLLAPSE_RUN = 16
UNK_FRACTION = 0.25
LOOP_MAX_PERIOD = 16
LOOP_MIN_REPEATS = 3
LOOP_MIN_TOKENS = 8

BUILTIN_PROMPTS = (
    "It is a truth universally acknowledged, that",
    "The old man looked out over the sea and",
    "In the beginning",
    "Here is a list of three colours: red,",
    "Question: What is the capital of France?\nAnswer:",
    "def add(a, b):\n",
    "The history of the city begins in the year",
    "Dear Sir,\n\nI am writing to you about",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:",
    "Once upon a time, in a small village by the river,",
    "The three laws of motion state that",
    "import numpy as np\n\ndef mean(values):\n",
    "Chapter One\n\nThe rain had not stopped for three days when",
    "Q: How many legs does a spider have?\nA:",
    "The following is a conversation between a teacher and a student.\nTeacher:",
    "In summary, the main reasons for the decline of the empire were",
)
"""Prompts of ``salaquant eval``'s generation checks; ``--gen-prompts N`` takes the first N."""
DEFAULT_GEN_PROMPTS = 6


@dataclass
class Greedy:
    tokens: list[int]  # generated tokens only
    nonfinite_step: int | None  # 0: the prefill's logits; k: the k-th decode step; None: all finite


def continue_batch(
    model: Any,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    attention_mode: str,
    eos_id: int | None = None,
    sampling: Sampling | None = None,
    seed: int | None = None,
) -> list[Greedy]:
    """Continuations of 1-D ``prompts`` (greedy, or drawn as ``sampling`` says from a generator seeded with
    ``seed``), decoded together by the runtime's ``Decoder`` (static cache; a CUDA graph per step on a GPU),
    checking every logit and the prefill's hidden states at every position."""
    from ..runtime.decode import Decoder

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    out = Decoder(model, attention_mode=attention_mode).generate_checked(
        prompts, max_new_tokens, sampling, generator, eos_id
    )
    return [Greedy(c.tokens.tolist(), c.nonfinite_step) for c in out]


def greedy(
    model: Any, input_ids: torch.Tensor, max_new_tokens: int, attention_mode: str, eos_id: int | None = None
) -> Greedy:
    """Greedy ``continue_batch`` of one prompt ``input_ids [1, T]``."""
    return continue_batch(model, [input_ids[0]], max_new_tokens, attention_mode, eos_id)[0]


def longest_run(tokens: list[int]) -> tuple[int | None, int]:
    """(token, length) of the longest run of one repeated token; (None, 0) for an empty list."""
    best: tuple[int | None, int] = (None, 0)
    run = 0
    for i, t in enumerate(tokens):
        run = run + 1 if i > 0 and tokens[i - 1] == t else 1
        if run > best[1]:
            best = (t, run)
    return best


def collapse(tokens: list[int], unk_id: int | None, run: int = COLLAPSE_RUN, unk_fraction: float = UNK_FRACTION) -> str:
    """Why the continuation counts as collapsed ("" when it does not)."""
    if not tokens:
        return ""
    if unk_id is not None:
        unk = sum(t == unk_id for t in tokens)
        if unk >= unk_fraction * len(tokens):
            return f"unknown token {unk_id} in {unk} of {len(tokens)} positions"
    token, length = longest_run(tokens)
    if len(tokens) >= 2 and length >= min(run, len(tokens)):
        return f"token {token} repeated {length} times"
    return ""


@dataclass
class Loop:
    period: int
    start: int  # index of the first token of the periodic stretch
    length: int  # tokens in the stretch

    def summary(self) -> dict[str, int]:
        return {"period": self.period, "start": self.start, "length": self.length}


def find_loop(
    tokens: list[int],
    max_period: int = LOOP_MAX_PERIOD,
    min_repeats: int = LOOP_MIN_REPEATS,
    min_tokens: int = LOOP_MIN_TOKENS,
) -> Loop | None:
    """The smallest period p whose stretch (``tokens[i] == tokens[i - p]`` throughout, plus its first block) is at
    least ``min_repeats * p`` and ``min_tokens`` long; the longest such stretch for that period."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        best: Loop | None = None
        matched = 0  # consecutive i with tokens[i] == tokens[i - p]
        for i in range(p, n + 1):
            if i < n and tokens[i] == tokens[i - p]:
                matched += 1
                continue
            stretch = matched + p
            if matched and stretch >= max(min_repeats * p, min_tokens) and (best is None or stretch > best.length):
                best = Loop(period=p, start=i - stretch, length=stretch)
            matched = 0
        if best is not None:
            return best
    return None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the sequences differ (the shorter length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_shares(tokens: list[int], unk_id: int | None) -> dict[str, Any]:
    """The measures behind ``collapse``: the most frequent token and its share of the continuation, the share of
    the unknown token and of token 0 (the id the seeds' collapsed answers filled with), and the longest run of one
    token."""
    if not tokens:
        return {"top_token": None, "top_share": 0.0, "unk_share": 0.0, "token0_share": 0.0, "longest_run": 0}
    top, count = Counter(tokens).most_common(1)[0]
    return {
        "top_token": top,
        "top_share": count / len(tokens),
        "unk_share": (sum(t == unk_id for t in tokens) / len(tokens)) if unk_id is not None else 0.0,
        "token0_share": sum(t == 0 for t in tokens) / len(tokens),
        "longest_run": longest_run(tokens)[1],
    }


def check_continuation(g: Greedy, unk_id: int | None) -> dict[str, Any]:
    loop = find_loop(g.tokens)
    return {
        "tokens": g.tokens,
        "collapse": collapse(g.tokens, unk_id),
        "loop": loop.summary() if loop is not None else None,
        "nonfinite_step": g.nonfinite_step,
    } | token_shares(g.tokens, unk_id)


def load_prompts(path: Path, tokenizer: Any) -> list[str]:
    """Prompts from a file: JSON Lines (``prompt``, else the text fields calibration reads) or plain text, one
    prompt per non-empty line. Raises ``CalibrationError`` naming the file and line."""
    from ..calibration.calib_data import CalibrationError, json_objects, record_text

    if not path.is_file():
        raise CalibrationError(f"--prompts {path}: no such file")
    prompts: list[str] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix.lower() in (".jsonl", ".json"):
        for where, record in json_objects(lines, path):
            prompt = record.get("prompt")
            prompts.append(prompt if isinstance(prompt, str) else record_text(record, tokenizer, None, where))
    else:
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CalibrationError(f"--prompts {path}: no prompt in the file")
    return prompts
