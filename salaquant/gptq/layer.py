"""GPTQ for one SALA decoder layer: smoothing, then one full-Hessian solve per input group.

Plugged into the calibration engine as its quantizer. For each input group the Hessian (shared by the
group's linears) is taken from the engine's statistics, smoothed when SmoothQuant is on, and the members
with the same plan are solved together (GPTQ is independent per output row given H, so stacking the rows
of q/k/v or gate/up gives each member exactly its own solution with a single factorisation). The layer
that comes back carries the dequantized weights, so the next layer is calibrated on quantized outputs; the
tensors that come back are already in the export layout (GPTQ v1 for quantized linears, bf16 otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from ..calibration.contract import LayerResult
from ..calibration.distributed import SINGLE, Ranks, spread
from ..calibration.stats import GroupStats, LayerStats
from ..formats.gptq_v1.dynamic import LinearPlan
from ..formats.gptq_v1.packing import pack_gptq_v1
from ..model.config import SalaConfig
from ..model.layout import input_groups
from ..model.modeling import DecoderLayer
from ..serving import PLAIN_DTYPE
from ..settings import defaults, smoothing_for
from ..smooth.fold import fold_scales, smooth_scales, smoothable, transform_hessian
from .solver import GPTQConfig, GPTQResult, error_ratio, gptq, row_weighted_errors, rtn

_DEFAULTS = defaults("gptq")
_SMOOTH = smoothing_for(_DEFAULTS)


@dataclass(frozen=True)
class GPTQLayerOptions:
    """The GPTQ settings of one layer's solve; defaults are ``salaquant.settings``'."""

    damp: float = _DEFAULTS.gptq.damp
    block_size: int = _DEFAULTS.gptq.block_size
    act_order: bool = _DEFAULTS.gptq.act_order
    mse: bool = _DEFAULTS.gptq.mse  # clipped scales searched per (row, group) for the least squared error
    fp64: bool = _DEFAULTS.gptq.fp64
    smooth_alpha: float | None = _SMOOTH[0]  # None: no smoothing
    smooth_groups: tuple[str, ...] = _SMOOTH[1]
    hessian_weighting: str = _DEFAULTS.gptq.hessian_weighting  # "samples": every sample weighs the same; "tokens"
    method: str = _DEFAULTS.method  # or "rtn": round to nearest on the same grid (the baseline), same export

    def solver_config(self, bits: int, group_size: int) -> GPTQConfig:
        return GPTQConfig(
            bits=bits,
            group_size=group_size,
            damp=self.damp,
            block_size=self.block_size,
            act_order=self.act_order,
            mse=self.mse,
            fp64=self.fp64,
        )

    def hessian(self, stats: GroupStats):
        """The Hessian GPTQ uses for a group, per ``hessian_weighting``."""
        return stats.hessian_per_sample() if self.hessian_weighting == "samples" else stats.hessian_mean()


class GPTQLayerQuantizer:
    """``quantize_layer`` for the calibration engine (see ``salaquant.calibration.engine.LayerQuantizer``)."""

    def __init__(
        self, config: SalaConfig, plan: dict[str, LinearPlan], options: GPTQLayerOptions, ranks: Ranks = SINGLE
    ) -> None:
        if options.method not in ("gptq", "rtn"):
            raise ValueError(f"method {options.method!r}: expected 'gptq' or 'rtn'")
        if options.hessian_weighting not in ("samples", "tokens"):
            raise ValueError(f"hessian weighting {options.hessian_weighting!r}: expected 'samples' or 'tokens'")
        self.config = config
        self.plan = plan
        self.opts = options
        self.ranks = ranks

    @torch.no_grad()
    def quantize_layer(self, index: int, layer: DecoderLayer, stats: LayerStats) -> LayerResult:
        prefix = f"model.layers.{index}."
        groups = input_groups(self.config, layer.kind)
        hessians: dict[str, torch.Tensor] = {}
        smoothed: dict[str, float] = {}
        for g in groups:
            st = stats[g.name]
            h = self.opts.hessian(st)
            quantized = any(self.plan[prefix + m].bits is not None for m in g.members)
            if self.opts.smooth_alpha is not None and quantized and smoothable(g) and g.name in self.opts.smooth_groups:
                act = st.mean_sq().sqrt()
                weights = [layer.get_submodule(m).weight for m in g.members]
                s = smooth_scales(act, weights, self.opts.smooth_alpha)
                fold_scales(layer, g, s)
                h = transform_hessian(h, s.to(h.device))
                smoothed[g.name] = float(s.max() / s.min())
            hessians[g.name] = h

        tensors: dict[str, torch.Tensor] = {}
        report: dict[str, Any] = {"layer": index, "kind": layer.kind, "linears": {}, "smooth_scale_range": smoothed}
        jobs: list[tuple[list[str], list[nn.Module], torch.Tensor, LinearPlan]] = []
        for g in groups:
            h = hessians[g.name]
            by_plan: dict[LinearPlan, list[str]] = {}
            for m in g.members:
                by_plan.setdefault(self.plan[prefix + m], []).append(m)
            for p, members in by_plan.items():
                mods = [layer.get_submodule(m) for m in members]
                if p.bits is None:
                    for m, mod in zip(members, mods, strict=True):
                        tensors[f"{m}.weight"] = mod.weight.data.to(PLAIN_DTYPE).cpu()
                        report["linears"][m] = {"bits": 16}
                    continue
                jobs.append((members, mods, h, p))
        # Each solve runs on one process (the costliest first, to the least loaded), its results go to all.
        costs = [sum(m.weight.shape[0] for m in mods) * h.shape[0] ** 2 + h.shape[0] ** 3 / 3 for _, mods, h, _ in jobs]
        for got, entries in spread([partial(self._solve, *job) for job in jobs], costs, self.ranks):
            report["linears"].update(entries)
            for key, value in got.items():
                kind, name = key.split(":", 1)
                if kind == "export":
                    tensors[name] = value.cpu()
                else:  # the dequantized weight the layer propagates with
                    mod = layer.get_submodule(name)
                    mod.weight.data = value.to(mod.weight.device, mod.weight.dtype)
        for name, module in layer.named_modules():
            if name.endswith("norm") and hasattr(module, "weight"):
                tensors[f"{name}.weight"] = module.weight.data.to(PLAIN_DTYPE).cpu()
        return LayerResult(layer=layer, tensors=tensors, report=report)

    def _solve(
        self, members: list[str], mods: list[nn.Module], h: torch.Tensor, p: LinearPlan
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One stacked solve: the members' export tensors (``export:NAME``) and dequantized weights
        (``weight:MEMBER``, what the layer propagates with), and their report entries."""
        assert p.bits is not None
        tensors: dict[str, torch.Tensor] = {}
        report: dict[str, Any] = {}
        cfg = self.opts.solver_config(p.bits, p.group_size)
        w = torch.cat([m.weight.data.float() for m in mods])
        t0 = time.perf_counter()
        w_rtn_q = rtn(w, replace(cfg, mse=False))  # the diagnostics' baseline: plain round to nearest
        if self.opts.method == "rtn":
            q = rtn(w, cfg) if cfg.mse else w_rtn_q
            result = GPTQResult(weight=q, loss=float("nan"), damp=0.0, seconds=time.perf_counter() - t0)
        else:
            result = gptq(w, h, cfg)
        seconds = time.perf_counter() - t0
        w_hat = result.weight.dequantize()
        # Per-row diagnostics, three products for the whole stack: the solution's error, RTN's, and the output energy.
        h64 = h.to(torch.float64)  # converted once for the three products
        row_loss = result.row_loss if result.row_loss is not None else row_weighted_errors(w, w_hat, h64)
        row_rtn = row_weighted_errors(w, w_rtn_q.dequantize(), h64)
        row_total = row_weighted_errors(w, None, h64)
        row = 0
        for name, mod in zip(members, mods, strict=True):
            out = mod.weight.shape[0]
            rows = slice(row, row + out)
            row += out
            codes = result.weight.codes[rows]
            scales = result.weight.scales[:, rows]
            packed = pack_gptq_v1(codes, scales, result.weight.g_idx, p.bits, result.weight.zero)
            for key, value in packed.items():
                tensors[f"export:{name}.{key}"] = value.detach().clone()  # members share g_idx: copy
            tensors[f"weight:{name}"] = w_hat[rows].to(mod.weight.dtype)
            report[name] = {
                "bits": p.bits,
                "group_size": p.group_size,
                "loss": float(row_loss[rows].sum()),
                "rel_err": error_ratio(float(row_loss[rows].sum()), float(row_total[rows].sum())),
                "rtn_rel_err": error_ratio(float(row_rtn[rows].sum()), float(row_total[rows].sum())),
                "damp": result.damp,
                "seconds": seconds * out / w.shape[0],
            }
        return tensors, report
