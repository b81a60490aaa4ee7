"""Whether GPTQ rounding aware of the FP4 activations lowers the W4A4 output error of single linears of sala-tiny.

For each named linear, its inputs on the first ``--fit`` samples of the shipped calibration set (at most
``--max-len`` tokens each) fit the solves and its inputs on the remaining samples score them. ``X`` are the inputs,
``Xq`` their FP4 quantization as the FP4 GEMM makes it (ModelOpt's numerics, the max-rule input scale of the fit
inputs), ``Y = X W^T`` the float outputs; each figure is ``|Xq W_hat^T - Y|^2 / |Y|^2`` on the scored inputs (W4A4)
and ``|X W_hat^T - Y|^2 / |Y|^2`` (weight-only):

* A4 only: ``W_hat = W`` (the activations' own error);
* plain: GPTQ rounding under ``H = X^T X`` (what the export does, block scales searched during the sweep);
* aware: the least-squares target ``W Hxq (Hq + damp)^-1`` (``Hxq = X^T Xq``, ``Hq = Xq^T Xq``: the exact
  cross-covariance, not an independent-noise model) rounded by GPTQ under ``Hq``, and that target unrounded;
* ``Hq`` only: GPTQ rounding of ``W`` under ``Hq``.

  python benchmarks/studies/w4a4_aware_linears.py model.layers.1.mlp.down_proj ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CALIB, TINY

from salaquant.calibration.calib_data import CalibOptions, load_calibration
from salaquant.formats.modelopt_nvfp4.numerics import global_scale, input_scale, quantize_activations
from salaquant.model.loading import load_model
from salaquant.nvfp4.gptq import gptq_nvfp4
from salaquant.workflow import load_tokenizer


def _inputs(model: torch.nn.Module, names: list[str], samples: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Each named linear's input ``[tokens, in]`` per sample (fp32 model, dense attention)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]).clone())
        )
        for n in names
    ]
    with torch.no_grad():
        for ids in samples:
            model(ids[None], attention_mode="dense")
    for h in handles:
        h.remove()
    return seen


def _gptq(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """GPTQ-rounded NVFP4 of ``w`` under ``h`` (the default: scales searched during the sweep), dequantized."""
    solved = gptq_nvfp4(w.float(), h.float(), global_scale(w.abs().max().float()), torch.diag(h).float())
    return solved.weight.dequantize().double()


def _relative(x: torch.Tensor, w_hat: torch.Tensor, y: torch.Tensor) -> float:
    """``|x w_hat^T - y|^2 / |y|^2``."""
    return float((x @ w_hat.T - y).pow(2).sum() / y.pow(2).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("linears", nargs="+")
    ap.add_argument("--fit", type=int, default=28, help="samples that fit the solves; the rest score them")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--damp", type=float, default=0.01, help="of the mean diagonal of Hq, for the target")
    args = ap.parse_args()
    tok = load_tokenizer(TINY)
    samples = [s.ids for s in load_calibration([str(CALIB)], tok, CalibOptions(max_len=args.max_len)).samples]
    model = load_model(TINY, dtype="fp32")
    for name, xs in _inputs(model, args.linears, samples).items():
        x, xv = torch.cat(xs[: args.fit]).double(), torch.cat(xs[args.fit :]).double()
        w = model.get_submodule(name).weight.detach().double()
        scale = input_scale(x.abs().max().float())
        xq, xvq = (quantize_activations(t.float(), scale).double() for t in (x, xv))
        y = xv @ w.T
        h, hq = x.T @ x, xq.T @ xq
        damp = args.damp * torch.diag(hq).mean() * torch.eye(hq.shape[0], dtype=hq.dtype)
        target = w @ (x.T @ xq) @ torch.linalg.inv(hq + damp)
        plain, aware, hq_only = _gptq(w, h), _gptq(target, hq), _gptq(w, hq)
        print(
            f"{name} ({x.shape[0]} fit / {xv.shape[0]} scored tokens): A4 only {_relative(xvq, w, y):.5f} | "
            f"plain W4A4 {_relative(xvq, plain, y):.5f}, weight-only {_relative(xv, plain, y):.5f} | "
            f"aware W4A4 {_relative(xvq, aware, y):.5f}, weight-only {_relative(xv, aware, y):.5f} | "
            f"target unrounded W4A4 {_relative(xvq, target, y):.5f} | Hq only W4A4 {_relative(xvq, hq_only, y):.5f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
