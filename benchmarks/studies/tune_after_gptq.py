"""Whether block-output tuning after GPTQ lowers a 4-bit export's error: signed-gradient rounding offsets per
weight, each decoder layer fitted to the bf16 layer's outputs.

Start: salaquant's default export of sala-tiny in the chosen ``--format`` (``benchmarks/quality.py``'s calibration
set): ``nvfp4`` (GPTQ rounding, scored W4A4 with the FP4 activations in the loop) or ``w4a16`` (GPTQ int4 g128,
scored weight-only). Its scales stay; each quantized weight's grid value ``c`` (the GPTQ code: an E2M1 value, or
the int4 code less its group's zero) becomes ``snap(c + v * step(c))`` with ``v`` in ``[-1, 1]`` learned
(``step``: the grid spacing at ``c``; ``v = 0`` is the export), straight-through gradients for the rounding of the
weights and, for nvfp4, of the activations. ``--tune-scales`` (w4a16) also learns a factor ``1 + u`` per group
scale, ``u`` in ``[-0.2, 0.2]``, stored as fp16 as the format stores scales. Layer by layer, in order: the target
is the bf16 layer applied to the bf16 model's hidden states (``--target float``) or to the tuned export's own
(``local``), the input the tuned export's hidden states, loss the mean squared error of the layer's output;
``--iters`` steps of signed gradient descent (step ``--lr`` decaying linearly to 0) on ``--batch`` samples drawn
each step. Scored as quality.py scores the format on its held-out windows, against the export before tuning.

  python benchmarks/studies/tune_after_gptq.py --out OUT --format nvfp4 --lr 0.0125 --keep-best 10
  python benchmarks/studies/tune_after_gptq.py --out OUT --format w4a16 --lr 0.005 --keep-best 10
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
from salaquant.formats.gptq_v1.packing import unpack_gptq_v1
from salaquant.formats.modelopt_nvfp4.numerics import (
    BLOCK,
    e2m1_codes,
    e2m1_values,
    quantize_activations,
    unpack_nibbles,
)
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.loading import load_model
from salaquant.model.modeling import layer_rope
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.workflow import load_tokenizer

SCALE_RANGE = 0.2
"""--tune-scales: each group scale's learned factor stays within 1 -/+ this."""


def read_nvfp4(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per quantized linear: its E2M1 values ``[out, in]``, fp32 block scales times the global scale (per weight),
    input scale."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in set(f.keys()):
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


def read_gptq(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per quantized linear: its codes less their group's zero ``[out, in]`` (float), the lowest and highest value
    the code range allows there, and the group scales, per weight (``scale``) and per group (``group_scale``,
    ``[out, groups]``; groups of consecutive inputs, as the default export writes them)."""
    bits = int(json.loads((path / "config.json").read_text())["quantization_config"]["bits"])
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in set(f.keys()):
                if not key.endswith(".qweight"):
                    continue
                name = key.removesuffix(".qweight")
                scales, g_idx = f.get_tensor(f"{name}.scales").float(), f.get_tensor(f"{name}.g_idx").long()
                n_in, n_out = g_idx.numel(), scales.shape[1]
                size = n_in // scales.shape[0]
                if not torch.equal(g_idx, torch.arange(n_in) // size):
                    raise SystemExit(f"{name}: g_idx is not consecutive groups of {size}; this study assumes them")
                codes, zeros = unpack_gptq_v1(f.get_tensor(key), f.get_tensor(f"{name}.qzeros"), bits, n_in, n_out)
                z = zeros.t()[:, g_idx].float()
                out[name] = {
                    "c": codes.float() - z,
                    "lo": -z,
                    "hi": (2**bits - 1) - z,
                    "scale": scales.t()[:, g_idx],
                    "group_scale": scales.t().contiguous(),
                }
    return out


def e2m1_step(c: torch.Tensor) -> torch.Tensor:
    """Spacing of the E2M1 grid at each value: 0.5 below 2, 1 below 4, 2 from there."""
    a = c.abs()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


class TunedWeight(nn.Module):
    """Parametrization of a linear's weight: grid values moved by learned offsets, times the scales (fixed, or each
    group's times a learned factor)."""

    def __init__(self, entry: dict[str, torch.Tensor], tune_scales: bool) -> None:
        super().__init__()
        self.fp4 = "lo" not in entry
        self.register_buffer("c", entry["c"])
        self.register_buffer("scale", entry["scale"])
        self.register_buffer("step", e2m1_step(entry["c"]) if self.fp4 else torch.ones(()))
        if not self.fp4:
            self.register_buffer("lo", entry["lo"])
            self.register_buffer("hi", entry["hi"])
        self.v = nn.Parameter(torch.zeros_like(entry["c"]))
        self.u = None
        if tune_scales:
            if self.fp4:
                raise SystemExit("--tune-scales: w4a16 only (NVFP4's block scales are FP8 values)")
            self.register_buffer("group_scale", entry["group_scale"])
            self.u = nn.Parameter(torch.zeros_like(entry["group_scale"]))

    def values(self) -> torch.Tensor:
        x = self.c + self.v * self.step
        if self.fp4:
            q = e2m1_values(e2m1_codes(x.detach()))
        else:
            q = torch.minimum(torch.maximum(torch.round(x.detach()), self.lo), self.hi)
        return x + (q - x).detach()

    def scales(self, stored: bool = False) -> torch.Tensor:
        """The per-weight scales; ``stored``: as the export would hold them (fp16 group scales)."""
        if self.u is None:
            return self.scale
        s = self.group_scale * (1 + self.u)
        if stored:
            s = s.half().float()
        return s.repeat_interleave(self.c.shape[1] // s.shape[1], dim=1)

    def forward(self, _weight: torch.Tensor) -> torch.Tensor:
        return self.values() * self.scales()

    def parameters_to_tune(self) -> list[nn.Parameter]:
        return [self.v] if self.u is None else [self.v, self.u]

    def clamp_(self) -> None:
        self.v.clamp_(-1, 1)
        if self.u is not None:
            self.u.clamp_(-SCALE_RANGE, SCALE_RANGE)


def fp4_inputs_ste(layer: nn.Module, prefix: str, export: dict[str, dict[str, torch.Tensor]]) -> list:
    """FP4 activations on the layer's quantized linears (NVFP4 exports), with straight-through gradients."""
    handles = []
    for name, module in layer.named_modules():
        full = f"{prefix}.{name}"
        if full in export and "input_scale" in export[full]:
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
    args,
) -> list[dict[str, float]]:
    """Tune every layer of ``model`` in order; returns each layer's loss before and after. ``args.target``:
    ``float`` (the bf16 layer on the bf16 model's hidden states) or ``local`` (the bf16 layer on the tuned export's
    own input, so a layer reproduces its own float function and leaves the error before it alone).
    ``args.keep_best``: every so many steps the loss over all samples is measured and the best parameters so far
    kept (0: the last)."""
    config, iters, keep_best = model.config, args.iters, args.keep_best
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        hf = [reference.model.embed_tokens(ids[None]) * config.scale_emb for ids in samples]
        hq = [model.model.embed_tokens(ids[None]) * config.scale_emb for ids in samples]
    log = []
    for i, (lf, lq) in enumerate(zip(reference.model.layers, model.model.layers, strict=True)):
        t0 = time.perf_counter()
        with torch.no_grad():
            target = [run_layer(lf, config, h) for h in (hf if args.target == "float" else hq)]
        prefix = f"model.layers.{i}"
        tuned = {
            name: TunedWeight(export[f"{prefix}.{name}"], args.tune_scales)
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
        params = [q for p in tuned.values() for q in p.parameters_to_tune()]
        for p in params:
            p.requires_grad_(True)
        best, kept = before, [p.detach().clone() for p in params]
        for step in range(iters if tuned else 0):
            idx = torch.randperm(len(samples), generator=gen)[: args.batch].tolist()
            grads = torch.autograd.grad(loss_on(idx), params)
            rate = args.lr * (1 - step / iters)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(rate * g.sign())
                for p in tuned.values():
                    p.clamp_()
                if keep_best and ((step + 1) % keep_best == 0 or step + 1 == iters):
                    now = float(loss_on(every))
                    if now < best:
                        best, kept = now, [p.detach().clone() for p in params]
        with torch.no_grad():
            if keep_best:  # the parameters of the lowest loss over every sample seen at a check (start included)
                for p, k in zip(params, kept, strict=True):
                    p.copy_(k)
            after = float(loss_on(every))
            moved = sum(int((p.values() != p.c).sum()) for p in tuned.values())
            total = sum(p.c.numel() for p in tuned.values())
        for h in handles:
            h.remove()
        for name, p in tuned.items():  # bake the tuned weights in, with the scales as the format stores them
            module = lq.get_submodule(name)
            with torch.no_grad():
                w = p.values() * p.scales(stored=True)
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


def export_of(fmt: str, out: Path, calib: CalibOptions) -> Path:
    """salaquant's default export of sala-tiny in ``fmt`` under ``out`` (written once, then reused)."""
    path = out / ("nvfp4-gptq" if fmt == "nvfp4" else "gptq-w4a16")
    if not (path / "config.json").exists():
        if fmt == "nvfp4":
            method = NVFP4Method(
                NVFP4LayerOptions(), NVFP4RunOptions(device="cpu", show_progress=False, overwrite=True)
            )
        else:
            run = RunOptions(device="cpu", show_progress=False, overwrite=True)
            method = GPTQMethod(BitsOptions(), GPTQLayerOptions(), run)
        run_method(TINY, path, [str(CALIB)], calib, method, quiet())
    return path


def main() -> None:
    ap = quality_parser(__doc__)
    ap.add_argument("--format", choices=("nvfp4", "w4a16"), default="nvfp4")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", choices=("float", "local"), default="float")
    ap.add_argument("--keep-best", type=int, default=0, help="every N steps: loss on all samples, keep the best")
    ap.add_argument("--tune-scales", action="store_true", help="w4a16: also a factor per group scale")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tok = load_tokenizer(TINY)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len)
    samples = [s.ids for s in load_calibration([str(CALIB)], tok, calib).samples]
    wins = windows(load_eval_text(None, tok, tok.eos_token_id).tokens, args.window_len, args.windows)
    export_dir = export_of(args.format, args.out, calib)
    export = read_nvfp4(export_dir) if args.format == "nvfp4" else read_gptq(export_dir)

    def scored(model: nn.Module) -> nn.Module:  # W4A4 for nvfp4 (its input scales), weight-only for w4a16
        if args.format != "nvfp4":
            return model
        return fp4_activations(model, {n: float(e["input_scale"]) for n, e in export.items()})

    reference = load_model(TINY)  # scored in the stored bf16, as quality.py scores
    rows = []
    with torch.no_grad():
        rows.append(
            {"variant": "export (GPTQ rounding)", **compare_models(reference, scored(load_model(export_dir)), wins)}
        )
    print(json.dumps(rows[-1]), flush=True)
    t0 = time.perf_counter()
    model = load_model(export_dir, dtype=torch.float32)
    log = tune(load_model(TINY, dtype=torch.float32), model, export, samples, args)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        tuned = scored(model.to(torch.bfloat16))
        label = f"tuned ({args.iters} steps, lr {args.lr}, {args.target} target, best of every {args.keep_best}"
        label += ", group scales too)" if args.tune_scales else ")"
        rows.append({"variant": label, **compare_models(reference, tuned, wins)})
    print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "layers": log, "tune_seconds": round(seconds), "settings": vars(args)}
    scales = "_scales" if args.tune_scales else ""
    name = f"tune_{args.format}_{args.target}_{args.iters}_{args.lr}_{args.keep_best}{scales}.json"
    (args.out / name).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
