"""GPU checks of sala-small's fast training path: the same logits as ``salaquant.model``, and its training speed
against the project's own model code, measured in one run.

* parity: a checkpoint (``--checkpoint``, else random weights written as one) loaded by
  ``salaquant.model.loading.load_model`` runs its reference code (fp32 Simple GLA, SDPA with GQA); the same bf16
  weights run the fast path twice: bf16 weights (inference) and fp32 weights under bf16 autocast (training).
  Printed: max and mean |logit difference|, top-1 agreement and KL per token against the reference.
* speed: one training step (forward, backward, AdamW) on ``--batch x --seq-len`` tokens, bf16 autocast with fp32
  master weights, timed over ``--steps`` steps after warm-up, for the project's model code (``model(ids,
  labels=ids)``, as ``tools/train_tiny.py`` trains) and for the fast path; tokens/s and their ratio.

  python tools/check_small.py [--checkpoint DIR] --json OUT/check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sala_small import build_model, use_fast_path, use_reference_path, write_checkpoint

from salaquant.model.loading import load_model
from salaquant.model.modeling import SalaForCausalLM, init_weights


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """|difference| statistics, top-1 agreement and mean KL(ref || other) of two fp32 logit tensors."""
    diff = (ref - other).abs()
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean()
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "ref_std": float(ref.std()),
        "top1": float((ref.argmax(-1) == other.argmax(-1)).float().mean()),
        "kl": float(kl),
    }


def parity(ckpt: Path, seq_len: int, dev: torch.device) -> dict[str, Any]:
    ref = load_model(ckpt, device=dev)
    ids = torch.randint(3, ref.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1)).to(dev)
    use_reference_path(ref)
    with torch.no_grad():
        want = ref(ids, attention_mode="dense").logits
        fast = load_model(ckpt, device=dev)
        use_fast_path(fast)
        bf16 = fast(ids, attention_mode="dense").logits
        master = load_model(ckpt, device=dev, dtype=torch.float32)
        use_fast_path(master)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            auto = master(ids, attention_mode="dense").logits
        use_reference_path(master)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            auto_ref = master(ids, attention_mode="dense").logits
    use_reference_path(ref)
    return {
        "seq_len": seq_len,
        "fast_bf16_vs_reference": compare(want, bf16),
        "fast_autocast_vs_reference": compare(want, auto),
        "reference_autocast_vs_reference": compare(want, auto_ref),
    }


def speed(model: SalaForCausalLM, fast: bool, batch: int, seq_len: int, steps: int, dev: torch.device) -> float:
    """Training tokens per second of ``model`` (fp32 weights) on the fast or the reference path."""
    (use_fast_path if fast else use_reference_path)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq_len), device=dev)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, attention_mode="dense").loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * seq_len * steps / (time.time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=Path("models/sala-tiny"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if ckpt is None:
            model = build_model()
            init_weights(model, std=0.02, generator=torch.Generator().manual_seed(0))
            ckpt = write_checkpoint(model, Path(tmp) / "random", args.tokenizer)
        out["checkpoint"] = str(args.checkpoint or "random weights")
        out["parity"] = [parity(ckpt, n, dev) for n in (1024, 4096)]
        print(json.dumps(out["parity"], indent=1), flush=True)
        if not args.no_speed:
            model = load_model(ckpt, device=dev, dtype=torch.float32).requires_grad_(True)
            params = sum(p.numel() for p in model.parameters())
            ref = speed(model, False, args.batch, args.seq_len, max(2, args.steps // 2), dev)
            fast = speed(model, True, args.batch, args.seq_len, args.steps, dev)
            out["speed"] = {
                "batch": args.batch,
                "seq_len": args.seq_len,
                "params": params,
                "reference_tokens_per_s": round(ref),
                "fast_tokens_per_s": round(fast),
                "ratio": round(fast / ref, 2),
                "fast_tflops_6nd": round(6 * params * fast / 1e12, 1),
            }
            print(json.dumps(out["speed"]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
