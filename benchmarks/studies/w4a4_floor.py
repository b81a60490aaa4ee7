"""How much of NVFP4 W4A4's error is the activations' alone: the bf16 model with FP4 activations and bf16 weights.

The linears an NVFP4 export quantizes (default exclusions and ``--dense-all``) read their inputs through the FP4
activation quantizer (ModelOpt's numerics, as the FP4 GEMM does) at the static scale of ModelOpt's max rule
(``amax / (6 * 448)``, amax over the calibration set ``benchmarks/quality.py`` uses), with their weights left in
bf16; every other tensor is the bf16 model's. Scored on quality.py's held-out windows against the bf16 model.
No rounding of the weights can take an export's W4A4 KL much below this figure: with the weights exact, what is
left is the activations' error (the two errors add, to first order, when they are independent).

  python benchmarks/studies/w4a4_floor.py --out OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CALIB, TINY, fp4_activations, quality_parser

from salaquant.calibration.calib_data import CalibOptions, load_calibration
from salaquant.eval.data import load_eval_text
from salaquant.eval.perplexity import compare_models, windows
from salaquant.formats.modelopt_nvfp4.numerics import input_scale
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model
from salaquant.nvfp4.plan import build_nvfp4_plan
from salaquant.workflow import load_tokenizer


@torch.no_grad()
def calibrated_amax(model: torch.nn.Module, names: set[str], samples: list[torch.Tensor]) -> dict[str, float]:
    """The largest absolute input each named linear sees over ``samples`` (one forward each, dense attention)."""
    amax = dict.fromkeys(names, 0.0)

    def hook(name: str):
        def record(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax[name], float(args[0].abs().amax()))

        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    for ids in samples:
        model(ids[None], attention_mode="dense")
    for h in handles:
        h.remove()
    return amax


def main() -> None:
    ap = quality_parser(__doc__)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = load_tokenizer(TINY)
    wins = windows(load_eval_text(None, tok, tok.eos_token_id).tokens, args.window_len, args.windows)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    samples = [s.ids for s in load_calibration([str(CALIB)], tok, calib).samples]
    reference = load_model(TINY)
    config = SalaConfig.from_dict(json.loads((TINY / "config.json").read_text()))
    rows = []
    for label, dense_all in (("default", False), ("dense-all", True)):
        names = build_nvfp4_plan(config, dense_all=dense_all).quantized
        amax = calibrated_amax(reference, names, samples)
        a4 = fp4_activations(load_model(TINY), {n: float(input_scale(a)) for n, a in amax.items()})
        with torch.no_grad():
            score = compare_models(reference, a4, wins)
        rows.append({"exclusions": label, "linears": len(names), **score})
        print(json.dumps(rows[-1]))
    result = {"rows": rows, "windows": [args.windows, args.window_len], "seconds": round(time.perf_counter() - t0)}
    (args.out / "w4a4_floor.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
