"""How well a checkpoint answers the training tasks themselves (``tools/longctx_tasks.py`` at a seed never trained
on): per kind and length, the share of supervised tokens whose argmax is right (teacher forced) and the share of
instances whose whole answer is. Tells a model that never learned a task from one that does not carry it over to
eval's phrasings. A ``copy`` row scores the plainest retrieval of all: random tokens repeated once, the second copy
predicted (an induction circuit gets it near 1).

  python tools/probe_small.py CKPT --corpus work_data/corpus/heldout_tokens.u16.npy --lengths 1024,4096
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longctx_tasks import KINDS, TaskGenerator

from salaquant.model.loading import load_model


def copy_accuracy(model: torch.nn.Module, length: int, seed: int, dev: torch.device) -> float:
    """Argmax accuracy on the second half of ``[BOS] x x`` for random tokens ``x`` (ids 3..4095)."""
    half = (length - 1) // 2
    x = torch.randint(3, 4096, (2, half), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), x, x], dim=1).to(dev)
    with torch.no_grad():
        pred = model(ids, attention_mode="auto").logits[:, half + 1 : -1].argmax(-1).cpu()
    return float((pred == x[:, 1:]).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--corpus", type=Path, required=True, help="haystack tokens (the held-out split: never trained)")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.checkpoint, device=dev)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    gen = TaskGenerator(tok, np.load(args.corpus).astype(np.int32), 1, 2, args.seed)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        for kind in KINDS:
            right = total = whole = 0
            for i in range(args.samples):
                s = gen.make(i, n, kind)
                ids = torch.from_numpy(s.ids.astype(np.int64))[None].to(dev)
                with torch.no_grad():
                    pred = model(ids, attention_mode="auto").logits[0, :-1].argmax(-1).cpu().numpy()
                sup = np.flatnonzero(s.mask[1:])
                ok = pred[sup] == s.ids[1:][sup]
                right, total, whole = right + int(ok.sum()), total + ok.size, whole + int(ok.all())
            rows.append({"kind": kind, "length": n, "token_acc": right / total, "whole": whole / args.samples})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"kind": "copy", "length": n, "token_acc": copy_accuracy(model, n, args.seed, dev)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
