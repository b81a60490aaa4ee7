"""Train sala-small (``tools/sala_small.py``) on one GPU: corpus language modelling mixed with the long-context tasks
of ``tools/longctx_tasks.py``, resumable, so that training runs as a series of calls under 10 minutes each.

Every step holds a stage's ``tokens_per_step`` tokens in rows of one length drawn from its ``lengths`` (512 to
16K): an ``lm_share`` of the rows are corpus slices trained on every token, the others task instances trained on
their answers only. ``--recipe`` runs the shipped model's stages (``RECIPE``) in order, each with a fixed schedule
(AdamW, warm-up, cosine to 10%), a fresh optimiser and the previous stage's weights rounded to bf16; without it,
the command-line flags make one stage whose first call times a few steps of each length and fixes its schedule from
``--train-minutes``. Each call trains until its ``--minutes`` are spent, saves the resumable state (``--state``:
fp32 weights, optimizer, stage and step; every batch is a function of the stage's seed and the step) and writes
the bf16 checkpoint in the real format (``--out``), which a later call can also resume from, with a fresh
optimizer, where the state is lost (``--resume-from``). The validation split is the tail of the train split
(never a haystack); the held-out split is read only for the perplexity printed at the end of a call.

  python tools/train_small.py --recipe --train work_data/corpus/train_tokens.u16.npy \\
      --heldout work_data/corpus/heldout_tokens.u16.npy --tokenizer models/sala-tiny \\
      --out OUT/sala-small --state /tmp/sala-small.pt --minutes 9.5      # again until all stages are done
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longctx_tasks import TaskGenerator, sentence_ends
from probe_small import copy_accuracy
from sala_small import build_model, use_fast_path, write_checkpoint

from salaquant.eval.perplexity import perplexity
from salaquant.model.loading import load_model
from salaquant.model.modeling import init_weights, lm_logits

BOS, EOS = 1, 2


def parse_weights(text: str) -> dict[str, float]:
    """``"kv:2,chain:1"`` -> {"kv": 2.0, "chain": 1.0}."""
    out = {}
    for part in text.split(","):
        name, _, w = part.partition(":")
        out[name] = float(w or 1)
    return out


def parse_lengths(text: str) -> dict[int, float]:
    """``"1024:1,4096:2"`` -> {1024: 1.0, 4096: 2.0} (row length -> weight of the steps at that length)."""
    return {int(n): w for n, w in parse_weights(text).items()}


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class Stage:
    """One schedule of the curriculum: its data mix, optimiser settings and length. ``schedule`` is the step count
    the learning rate decays over (0: timed from ``--train-minutes`` on the first call); ``steps`` where training
    stops (the shipped run ended two stages a few steps before their schedule's end, where a call's time ran out)."""

    name: str
    lengths: str
    kinds: str
    lm_share: float
    lr: float
    warmup: int
    tokens_per_step: int
    seed: int
    schedule: int = 0
    steps: int = 0
    max_keys: int = 16
    max_questions: int = 4


LONG_LENGTHS = "1024:1,2048:2,4096:3,8192:2,16384:2"
SHORT_KINDS = "repeat:0.35,kv:0.35,multivalue:0.1,chain:0.1,common:0.05,frequent:0.05"
MIXED_KINDS = "kv:0.3,multivalue:0.1,chain:0.25,common:0.1,frequent:0.1,repeat:0.15"
RECIPE = (
    Stage("short", "512:1,1024:2,2048:2,4096:1", SHORT_KINDS, 0.2, 3e-3, 100, 65536, 0, 3488, 3488),
    Stage("long", LONG_LENGTHS, "", 0.2, 2e-3, 50, 131072, 1, 1585, 1526),
    Stage("copy", "512:1,1024:1", "repeat:1", 0.1, 2e-3, 50, 65536, 2, 3068, 3051),
    Stage("mixed", "1024:1,2048:1,4096:2,8192:2,16384:2", MIXED_KINDS, 0.05, 1e-3, 30, 131072, 5, 1500, 965),
)  # fmt: skip
"""The shipped sala-small's curriculum: short mixed tasks from random weights, the long mix, repeated spans alone
(the copy circuit formed there within 200 steps, after two stages without it), then the long tasks again with the
copy circuit in place (16K needles and several values; little language modelling, the corpus being nearly spent)."""


class Batches(torch.utils.data.IterableDataset):
    """Step ``s``'s rows, from ``start`` on; worker ``w`` of ``W`` builds the steps ``s = w (mod W)``, so the
    DataLoader's round robin yields them in order. Everything is a function of ``(seed, s)``."""

    def __init__(self, stage: Stage, tokenizer: Path, corpus: np.ndarray, ends: np.ndarray, start: int) -> None:
        self.stage, self.tokenizer, self.corpus, self.ends, self.start = stage, tokenizer, corpus, ends, start
        self.lengths = parse_lengths(stage.lengths)

    def step_plan(self, step: int) -> tuple[int, int, int]:
        """(row length, rows, LM rows) of ``step``."""
        rng = random.Random(f"plan:{self.stage.seed}:{step}")
        n = rng.choices(list(self.lengths), list(self.lengths.values()))[0]
        rows = max(1, self.stage.tokens_per_step // n)
        lm = rows * self.stage.lm_share
        lm_rows = int(lm) + (rng.random() < lm - int(lm))
        return n, rows, lm_rows

    def build(self, gen: TaskGenerator, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        n, rows, lm_rows = self.step_plan(step)
        rng = np.random.default_rng([self.stage.seed, step])
        ids = np.empty((rows, n), dtype=np.int64)
        mask = np.zeros((rows, n), dtype=bool)
        for r in range(lm_rows):
            s = int(rng.integers(0, self.corpus.size - n))
            ids[r] = self.corpus[s : s + n]
            mask[r] = True
        for r in range(lm_rows, rows):
            sample = gen.packed(step * 1024 + r, n)
            ids[r], mask[r] = sample.ids, sample.mask
        return torch.from_numpy(ids), torch.from_numpy(mask), lm_rows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        from tokenizers import Tokenizer

        info = torch.utils.data.get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        tok = Tokenizer.from_file(str(self.tokenizer / "tokenizer.json"))
        kinds = parse_weights(self.stage.kinds) if self.stage.kinds else None
        gen = TaskGenerator(
            tok, self.corpus, BOS, EOS, self.stage.seed, kinds, self.ends, self.stage.max_keys, self.stage.max_questions
        )
        step = self.start + wid
        while True:
            yield self.build(gen, step)
            step += workers


def step_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, lm_rows: int) -> torch.Tensor:
    """Mean next-token loss over the LM rows' tokens plus mean loss over the task rows' supervised tokens (logits
    only where a loss is taken)."""
    normed = model.model(ids, attention_mode="dense")
    target = mask[:, 1:]
    h = normed[:, :-1][target]
    y = ids[:, 1:][target]
    logits = lm_logits(model.config, model.lm_head, h)
    nll = F.cross_entropy(logits, y, reduction="none")
    is_lm = (torch.arange(ids.shape[0], device=ids.device) < lm_rows)[:, None].expand_as(target)[target]
    parts = [nll[is_lm].mean()] if lm_rows else []
    if lm_rows < ids.shape[0]:
        parts.append(nll[~is_lm].mean())
    return sum(parts) / len(parts)


def custom_stage(args: argparse.Namespace) -> Stage:
    return Stage("custom", args.lengths, args.kinds, args.lm_share, args.lr, args.warmup, args.tokens_per_step,
                 args.seed, args.schedule, max_keys=args.max_keys, max_questions=args.max_questions)  # fmt: skip


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json (models/sala-tiny)")
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder written at the end of the call")
    ap.add_argument("--state", type=Path, default=Path("/tmp/sala-small-state.pt"))
    ap.add_argument("--recipe", action="store_true", help="the shipped model's stages (RECIPE) instead of one stage")
    ap.add_argument("--resume-from", type=Path, help="checkpoint to continue from where --state is missing")
    ap.add_argument("--init-from", type=Path, help="checkpoint whose weights start a new schedule (a curriculum stage)")
    ap.add_argument("--lengths", default=LONG_LENGTHS)
    ap.add_argument("--kinds", default="", help='task weights, e.g. "kv:3,chain:1" (default: the generator\'s)')
    ap.add_argument("--max-keys", type=int, default=16, help="keyed statements per kv instance at most")
    ap.add_argument("--max-questions", type=int, default=4, help="questions per kv instance at most")
    ap.add_argument("--tokens-per-step", type=int, default=131072)
    ap.add_argument("--lm-share", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--schedule", type=int, default=0, help="steps the learning rate decays over (0: timed)")
    ap.add_argument("--train-minutes", type=float, default=18.0, help="training time of a stage with no schedule")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall time of this call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--val-frac", type=float, default=0.02)
    args = ap.parse_args()
    call_start = time.time()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    stages = RECIPE if args.recipe else (custom_stage(args),)
    torch.manual_seed(stages[0].seed)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    all_train = np.load(args.train).astype(np.int32)
    n_val = int(all_train.size * args.val_frac)
    corpus, val = all_train[:-n_val], torch.from_numpy(all_train[-n_val:].astype(np.int64))
    heldout = torch.from_numpy(np.load(args.heldout).astype(np.int64))
    ends = sentence_ends(tok, 4096)

    model = build_model().to(dev)
    init_weights(model, std=0.02, generator=torch.Generator(device=dev).manual_seed(stages[0].seed))
    opt = make_optimizer(model, stages[0].lr)
    st: dict = {"stage": 0, "step": 0, "total_steps": 0, "tokens": 0, "lm_tokens": 0, "seconds": 0.0, "log": []}
    if args.state.exists():
        saved = torch.load(args.state, map_location=dev, weights_only=False)
        model.load_state_dict(saved.pop("model"))
        opt.load_state_dict(saved.pop("opt"))
        st = saved
        st.setdefault("stage", 0)
        print(f"resumed at stage {st['stage']}, step {st['step']} of {st['total_steps']}")
    elif args.resume_from is not None:
        summary = json.loads((args.resume_from / "train_summary.json").read_text())
        st = {k: summary.get(k, v) for k, v in st.items()}
        model.load_state_dict(load_model(args.resume_from, device=dev, dtype=torch.float32).state_dict())
        print(f"resumed from {args.resume_from} (bf16 weights, fresh optimizer) at step {st['step']}")
    elif args.init_from is not None:
        model.load_state_dict(load_model(args.init_from, device=dev, dtype=torch.float32).state_dict())
        print(f"new schedule from the weights of {args.init_from}")
    use_fast_path(model)
    model.train()
    budget = args.minutes * 60 - 75  # leave time for validation, saving and the checkpoint
    while st["stage"] < len(stages) and time.time() - call_start < budget:
        stage = stages[st["stage"]]
        train_stage(stage, st, model, opt, args, corpus, ends, dev, call_start + budget)
        if st["step"] >= (stage.steps or st["total_steps"]):  # the stage is done: the next starts from its weights
            print(f"stage {stage.name} done at step {st['step']}", flush=True)
            with torch.no_grad():  # rounded to bf16, as a stage written to disk and read back
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            st.update(stage=st["stage"] + 1, step=0, total_steps=0)
            if st["stage"] < len(stages):
                opt = make_optimizer(model, stages[st["stage"]].lr)
    if st["stage"] >= len(stages):
        print(f"all {len(stages)} stages done", flush=True)
    finish(st, model, opt, args, corpus, val, heldout, dev)


def train_stage(
    stage: Stage,
    st: dict,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    corpus: np.ndarray,
    ends: np.ndarray,
    dev: torch.device,
    deadline: float,
) -> None:
    """Steps of ``stage`` from ``st["step"]`` until its end or ``deadline``; a stage with no fixed schedule first
    times a few steps of each length and fixes one from ``--train-minutes``."""
    data = Batches(stage, args.tokenizer, corpus, ends, st["step"])
    loader = iter(
        torch.utils.data.DataLoader(data, batch_size=None, num_workers=args.workers, pin_memory=True, prefetch_factor=4)
    )

    def train_step(lr: float) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = lr
        ids, mask, lm_rows = next(loader)
        ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_loss(model, ids, mask, lm_rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st["tokens"] += ids.numel()
        st["lm_tokens"] += lm_rows * ids.shape[1]
        return loss.detach()

    if st["total_steps"] == 0 and stage.schedule:
        st["total_steps"] = stage.schedule
    if st["total_steps"] == 0:  # time the first steps (each length twice: the first call tunes kernels)
        seen: dict[int, list[float]] = {}
        while min(len(seen.get(n, [])) for n in data.lengths) < 2 and st["step"] < stage.warmup:
            n = data.step_plan(st["step"])[0]
            torch.cuda.synchronize()
            t0 = time.time()
            train_step(lr_at(st["step"], 10**6, stage.lr, stage.warmup))
            st["step"] += 1
            torch.cuda.synchronize()
            seen.setdefault(n, []).append(time.time() - t0)
        per = {n: min(ts[1:] or ts) for n, ts in seen.items()}
        weights = data.lengths
        mean = sum(per[n] * w for n, w in weights.items()) / sum(weights.values())
        st["total_steps"] = int(args.train_minutes * 60 / mean)
        st["step_seconds"] = per
        print(f"seconds per step by length {per}; schedule of {st['total_steps']} steps", flush=True)

    stop = stage.steps or st["total_steps"]
    torch.cuda.synchronize()
    t_last = time.time()
    while st["step"] < stop and time.time() < deadline:
        loss = train_step(lr_at(st["step"], st["total_steps"], stage.lr, stage.warmup))
        st["step"] += 1
        if st["step"] % 50 == 0:
            torch.cuda.synchronize()
            st["seconds"] += time.time() - t_last
            entry = {
                "stage": stage.name,
                "step": st["step"],
                "loss": round(float(loss), 4),
                "tokens": st["tokens"],
                "seconds": round(st["seconds"]),
            }
            if st["step"] % 200 == 0:  # whether a copy circuit has formed (random tokens repeated, 512 tokens)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    entry["copy_acc"] = round(copy_accuracy(model, 512, st["step"], dev), 3)
                torch.cuda.synchronize()
            t_last = time.time()
            st["log"].append(entry)
            print(entry, flush=True)
    torch.cuda.synchronize()
    st["seconds"] += time.time() - t_last


def finish(
    st: dict,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    corpus: np.ndarray,
    val: torch.Tensor,
    heldout: torch.Tensor,
    dev: torch.device,
) -> None:
    """Validation and held-out figures, the resumable state and the bf16 checkpoint with its summary."""
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        v = perplexity(lambda x: model(x, attention_mode="dense").logits, val, 1024, 32, 8, dev)
        h = perplexity(lambda x: model(x, attention_mode="dense").logits, heldout, 1024, 16, 8, dev)
    st["log"].append(
        {"stage": st["stage"], "step": st["step"], "val_nll": round(v.mean_nll, 4),
         "heldout_ppl_16x1024": round(h.perplexity, 3)}
    )  # fmt: skip
    print(st["log"][-1], flush=True)
    args.state.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**st, "model": model.state_dict(), "opt": opt.state_dict()}, args.state)
    write_checkpoint(model, args.out, args.tokenizer)
    summary = {
        **{k: v for k, v in st.items() if k != "log"},
        "lm_passes": st["lm_tokens"] / corpus.size,
        "args": {k: str(v) for k, v in vars(args).items()},
        "log": st["log"],
    }
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "args")}), flush=True)


if __name__ == "__main__":
    main()
