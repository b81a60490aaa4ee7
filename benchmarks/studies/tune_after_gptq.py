"""Whether block-output tuning after GPTQ lowers NVFP4 W4A4's error: signed-gradient rounding offsets per weight,
each decoder layer fitted to the bf16 layer's outputs with the FP4 activations in the loop.

Start: salaquant's default NVFP4 export of sala-tiny (GPTQ rounding, ``benchmarks/quality.py``'s calibration set).
Its block and global scales stay; each quantized weight's E2M1 value ``c`` (the GPTQ code) becomes
``e2m1(c + v * step(c))`` with ``v`` in ``[-1, 1]`` learned (``step``: the grid spacing at ``c``; ``v = 0`` is the
export), straight-through gradients for the rounding of the weights and of the activations. Layer by layer, in
order: the target is the bf16 layer applied to the bf16 model's hidden states, the input the tuned export's hidden
states (so a layer also corrects what the layers before it left), loss the mean squared error of the layer's
output; ``--iters`` steps of signed gradient descent (step ``--lr`` decaying linearly to 0) on ``--batch`` samples
drawn each step. Scored as quality.py scores W4A4 (FP4 activations at the export's input scales) on its held-out
windows, against the export before tuning.

  python benchmarks/studies/nvfp4_tune.py --out OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CALIB, TINY, fp4_activations, quality_parser, quiet

from salaquant.calibration.calib_data import CalibOptions, load_calibration
from salaquant.driver import run_method
from salaquant.eval.data import load_eval_text
from salaquant.eval.perplexity import compare_models, windows
from salaquant.formats.modelopt_nvfp4.numerics import (
    BLOCK,
    e2m1_codes,
    e2m1_values,
    quantize_activations,
    unpack_nibbles,
)
from salaquant.model.loading import load_model
from salaquant.model.modeling import layer_rope
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.workflow import load_tokenizer


def read_export(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per quantized linear: its E2M1 values ``[out, in]``, fp32 block scales times the global scale, input scale."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            keys = set(f.keys())
            for key in keys:
                if not key.endswith(".weight_scale_2"):
                    continue
                name = key.removesuffix(".weight_scale_2")
                codes = unpack_nibbles(f.get_tensor(f"{name}.weight"))
                s2 = f.get_tensor(key).float()
                scale = f.get_tensor(f"{name}.weight_scale").float() * s2
                out[name] = {
                    "c": e2m1_values(codes),
                    "scale": scale.repeat_interleave(BLOCK, dim=1),
                    "input_scale": f.get_tensor(f"{name}.input_scale").float(),
                }
    return out


def grid_step(c: torch.Tensor) -> torch.Tensor:
    """Spacing of the E2M1 grid at each value: 0.5 below 2, 1 below 4, 2 from there."""
    a = c.abs()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


class TunedWeight(nn.Module):
    """Parametrization of a linear's weight: E2M1 values moved by learned offsets, times the fixed scales."""

    def __init__(self, c: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("c", c)
        self.register_buffer("scale", scale)
        self.register_buffer("step", grid_step(c))
        self.v = nn.Parameter(torch.zeros_like(c))

    def values(self) -> torch.Tensor:
        x = self.c + self.v * self.step
        q = e2m1_values(e2m1_codes(x.detach()))
        return x + (q - x).detach()

    def forward(self, _weight: torch.Tensor) -> torch.Tensor:
        return self.values() * self.scale


def fp4_inputs_ste(layer: nn.Module, prefix: str, export: dict[str, dict[str, torch.Tensor]]) -> list:
    """FP4 activations on the layer's quantized linears, with straight-through gradients."""
    handles = []
    for name, module in layer.named_modules():
        full = f"{prefix}.{name}"
        if full in export:
            s = export[full]["input_scale"]
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, args, s=s: (args[0] + (quantize_activations(args[0].detach(), s) - args[0]).detach(),)
                )
            )
    return handles


def run_layer(layer: nn.Module, config, h: torch.Tensor) -> torch.Tensor:
    return layer(h, layer_rope(config, layer.kind, 0, h.shape[1], h.device), None, "dense")


def tune(
    reference: nn.Module,
    model: nn.Module,
    export: dict[str, dict[str, torch.Tensor]],
    samples: list[torch.Tensor],
    iters: int,
    lr: float,
    batch: int,
    seed: int,
    target_input: str = "float",
    keep_best: int = 0,
) -> list[dict[str, float]]:
    """Tune every layer of ``model`` in order; returns each layer's loss before and after. ``target_input``:
    ``float`` (the bf16 layer on the bf16 model's hidden states) or ``local`` (the bf16 layer on the tuned export's
    own input, so a layer reproduces its own float function and leaves the error before it alone). ``keep_best``:
    every so many steps the loss over all samples is measured and the best offsets so far kept (0: the last)."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf = [reference.model.embed_tokens(ids[None]) * config.scale_emb for ids in samples]
        hq = [model.model.embed_tokens(ids[None]) * config.scale_emb for ids in samples]
    log = []
    for i, (lf, lq) in enumerate(zip(reference.model.layers, model.model.layers, strict=True)):
        t0 = time.perf_counter()
        with torch.no_grad():
            target = [run_layer(lf, config, h) for h in (hf if target_input == "float" else hq)]
        prefix = f"model.layers.{i}"
        tuned = {
            name: TunedWeight(export[f"{prefix}.{name}"]["c"], export[f"{prefix}.{name}"]["scale"])
            for name, m in lq.named_modules()
            if isinstance(m, nn.Linear) and f"{prefix}.{name}" in export
        }
        for name, p in tuned.items():
            nn.utils.parametrize.register_parametrization(lq.get_submodule(name), "weight", p)
        handles = fp4_inputs_ste(lq, prefix, export)

        def loss_on(idx: list[int], lq: nn.Module = lq, hq: list = hq, target: list = target) -> torch.Tensor:
            parts = [nn.functional.mse_loss(run_layer(lq, config, hq[j]), target[j]) for j in idx]
            return sum(parts) / len(parts)

        every = list(range(len(samples)))
        with torch.no_grad():
            before = float(loss_on(every))
        params = [p.v for p in tuned.values()]
        for p in params:
            p.requires_grad_(True)
        best, kept = before, [p.detach().clone() for p in params]
        for step in range(iters if tuned else 0):
            idx = torch.randperm(len(samples), generator=gen)[:batch].tolist()
            loss = loss_on(idx)
            grads = torch.autograd.grad(loss, params)
            rate = lr * (1 - step / iters)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(rate * g.sign()).clamp_(-1, 1)
                if keep_best and ((step + 1) % keep_best == 0 or step + 1 == iters):
                    now = float(loss_on(every))
                    if now < best:
                        best, kept = now, [p.detach().clone() for p in params]
        with torch.no_grad():
            if keep_best:  # the offsets of the lowest loss over every sample seen at a check (v = 0 included)
                for p, k in zip(params, kept, strict=True):
                    p.copy_(k)
            after = float(loss_on(every))
            moved = sum(int((p.values() != p.c).sum()) for p in tuned.values())
            total = sum(p.c.numel() for p in tuned.values())
        for h in handles:
            h.remove()
        for name, p in tuned.items():  # bake the tuned weights in
            module = lq.get_submodule(name)
            with torch.no_grad():
                w = p.values() * p.scale
            nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            module.weight = nn.Parameter(w.to(module.weight.dtype), requires_grad=False)
        handles = fp4_inputs_ste(lq, prefix, export)
        with torch.no_grad():
            hf = target
            hq = [run_layer(lq, config, h) for h in hq]
        for h in handles:
            h.remove()
        log.append({"layer": i, "mse_before": before, "mse_after": after, "moved": moved, "weights": total,
                    "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(json.dumps(log[-1]), flush=True)
    return log


def main() -> None:
    ap = quality_parser(__doc__)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", choices=("float", "local"), default="float")
    ap.add_argument("--keep-best", type=int, default=0, help="every N steps: loss on all samples, keep the best")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tok = load_tokenizer(TINY)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    samples = [s.ids for s in load_calibration([str(CALIB)], tok, calib).samples]
    wins = windows(load_eval_text(None, tok, tok.eos_token_id).tokens, args.window_len, args.windows)
    export_dir = args.out / "nvfp4-gptq"
    if not (export_dir / "config.json").exists():
        run = NVFP4RunOptions(device="cpu", show_progress=False, overwrite=True)
        run_method(TINY, export_dir, [str(CALIB)], calib, NVFP4Method(NVFP4LayerOptions(), run), quiet())
    export = read_export(export_dir)
    scales = {n: float(e["input_scale"]) for n, e in export.items()}
    reference = load_model(TINY)  # scored in the stored bf16, as quality.py scores
    rows = []
    base = fp4_activations(load_model(export_dir), scales)
    with torch.no_grad():
        rows.append({"variant": "export (GPTQ rounding)", **compare_models(reference, base, wins)})
    print(json.dumps(rows[-1]), flush=True)
    t0 = time.perf_counter()
    model = load_model(export_dir, dtype=torch.float32)
    float_model = load_model(TINY, dtype=torch.float32)
    settings = (args.iters, args.lr, args.batch, args.seed, args.target, args.keep_best)
    log = tune(float_model, model, export, samples, *settings)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        tuned = fp4_activations(model.to(torch.bfloat16), scales)
        label = f"tuned ({args.iters} steps, lr {args.lr}, {args.target} target, best of every {args.keep_best})"
        rows.append({"variant": label, **compare_models(reference, tuned, wins)})
    print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "layers": log, "tune_seconds": round(seconds), "settings": vars(args)}
    name = f"nvfp4_tune_{args.target}_{args.iters}_{args.lr}_{args.keep_best}.json"
    (args.out / name).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
