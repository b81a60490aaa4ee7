"""Train the small SALA model shipped in models/sala-tiny with the project's own model code.

Runs on one GPU (bf16 autocast, fp32 master weights); the minicpm4 layers train in dense mode.
Each call trains until ``--minutes`` of wall time or ``--steps`` are reached, saves a resumable state
(``--state``) and, at the end, the checkpoint in the SALA format (sharded so every file stays small).

  python tools/train_tiny.py --train work_data/corpus/train_tokens.u16.npy \\
      --heldout work_data/corpus/heldout_tokens.u16.npy --tokenizer work_data/tokenizer \\
      --out OUT --minutes 8
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from salaquant.eval.perplexity import perplexity
from salaquant.io.writer import save_state_dict
from salaquant.model.config import SalaConfig
from salaquant.model.modeling import SalaForCausalLM, init_weights
from salaquant.model.tiny import preset_config


def load_tokens(path: Path) -> torch.Tensor:
    arr = np.load(path) if path.suffix == ".npy" else np.fromfile(path, dtype=np.uint16)
    return torch.from_numpy(arr.astype(np.int64))


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--state", type=Path, default=Path("/tmp/sala-train-state.pt"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--steps", type=int, default=0, help="total steps of the schedule (0: fit --minutes)")
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--val-frac", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args()

    torch.manual_seed(args.seed)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    tok_cfg = json.loads((args.tokenizer / "tokenizer.json").read_text())
    vocab = len(tok_cfg["model"]["vocab"]) + sum(
        1 for t in tok_cfg.get("added_tokens", []) if t["content"] not in tok_cfg["model"]["vocab"]
    )
    raw = preset_config(args.preset, vocab_size=int(math.ceil(vocab / 64) * 64))
    cfg = SalaConfig.from_dict(raw)
    model = SalaForCausalLM(cfg).to(dev)
    init_weights(model, std=0.02, generator=torch.Generator(device=dev).manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=True,
    )
    all_train = load_tokens(args.train)
    n_val = int(all_train.numel() * args.val_frac)
    train, val = all_train[:-n_val], all_train[-n_val:]  # validation: the tail of the train split
    heldout = load_tokens(args.heldout)  # never seen in training or model selection
    step, tokens_seen, train_seconds = 0, 0, 0.0
    rng = np.random.default_rng(args.seed)
    if args.state.exists():
        st = torch.load(args.state, map_location=dev, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, tokens_seen, train_seconds = st["step"], st["tokens_seen"], st["train_seconds"]
        rng = st["rng"]
        args.steps = st["total_steps"]
        print(f"resumed at step {step} ({tokens_seen / 1e6:.1f}M tokens)")
    fwd = torch.compile(model) if args.compile else model

    def batch() -> torch.Tensor:
        starts = rng.integers(0, train.numel() - args.seq_len - 1, size=args.batch)
        return torch.stack([train[s : s + args.seq_len] for s in starts]).to(dev, non_blocking=True)

    def train_step(lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        ids = batch()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = fwd(ids, labels=ids, attention_mode="dense")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    print(f"params {n_params / 1e6:.2f}M, train tokens {train.numel() / 1e6:.2f}M, vocab {cfg.vocab_size}")
    call_start = time.time()
    budget = args.minutes * 60
    if args.steps == 0:  # time a few steps, then fix the schedule length
        t0 = time.time()
        for _ in range(5):
            train_step(args.lr * 0.01)
        sync()
        per_step = (time.time() - t0) / 5
        args.steps = int((budget - (time.time() - call_start) - 60) / per_step)
        print(f"~{per_step * 1000:.0f} ms/step -> schedule of {args.steps} steps")

    def val_nll() -> float:
        model.eval()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            r = perplexity(lambda ids: model(ids, attention_mode="dense").logits, val, 1024, 32, 8, dev)
        model.train()
        return r.mean_nll

    log = []
    best = {"nll": float("inf"), "step": 0, "state": None}
    model.train()
    t_last = time.time()
    while step < args.steps and time.time() - call_start < budget - 45:
        loss = train_step(lr_at(step, args.steps, args.lr, args.warmup))
        step += 1
        tokens_seen += args.batch * args.seq_len
        if step % 100 == 0 or step == args.steps:
            sync()
            now = time.time()
            train_seconds += now - t_last
            t_last = now
            entry = {"step": step, "loss": loss, "tokens": tokens_seen, "seconds": train_seconds}
            if step % args.eval_every == 0 or step == args.steps:
                entry["val_nll"] = v = val_nll()
                if v < best["nll"]:
                    best = {
                        "nll": v,
                        "step": step,
                        "state": {k: t.detach().clone() for k, t in model.state_dict().items()},
                    }
                t_last = time.time()
            log.append(entry)
            print(
                " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()), flush=True
            )
    sync()
    train_seconds += time.time() - t_last
    v = val_nll()
    if v <= best["nll"]:
        best = {"nll": v, "step": step, "state": None}
    elif best["state"] is not None:
        print(f"restoring the best validation checkpoint (step {best['step']}, val nll {best['nll']:.4f})")
        model.load_state_dict(best["state"])
    model.eval()
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "tokens_seen": tokens_seen,
            "train_seconds": train_seconds,
            "rng": rng,
            "total_steps": args.steps,
        },
        args.state,
    )
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        ppl = perplexity(
            lambda ids: model(ids, attention_mode="dense").logits, heldout, 1024, max_windows=64, device=dev
        )
    print(f"held-out perplexity (fp32 weights, bf16 autocast, 64 x 1024 tokens): {ppl.perplexity:.2f}")
    done = step >= args.steps
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    raw_out = cfg.to_dict()
    raw_out["architectures"] = ["MiniCPMSALAForCausalLM"]
    save_state_dict(state, args.out / "model", raw_out, max_shard_bytes=15 * 10**6)
    summary = {
        "step": step,
        "total_steps": args.steps,
        "tokens_seen": tokens_seen,
        "train_seconds": train_seconds,
        "params": n_params,
        "heldout_ppl_autocast": ppl.perplexity,
        "best_step": best["step"],
        "best_val_nll": best["nll"],
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "finished": done,
        "log": log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}))


if __name__ == "__main__":
    main()
