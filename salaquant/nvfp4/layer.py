"""NVFP4 for one SALA decoder layer: 3-group SmoothQuant, fused global scales, block-scale search, then GPTQ
rounding (``gptq.py``) or rounding to nearest.

Plugged into the calibration engine as its quantizer: the search weighs each input column by its mean x^2 (the
diagonal of the Hessian); GPTQ rounding reads the full per-sample input Hessian, which the engine then collects.
Shared ``weight_scale_2`` and ``input_scale`` across every fused parameter (q/k/v, gate/up), block scales computed
against the shared value, every scale folded (no ``pre_quant_scale``). The layer handed back carries the dequantized
weights (weight-only fake quantization), so the next layer calibrates on quantized outputs. With the ``mse`` input-
scale rule (``input_scale.py``) each input's scale is chosen on the propagation pass through that layer, which sees
every calibration token's input to each quantized linear.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..calibration.contract import LayerResult
from ..calibration.distributed import SINGLE, Ranks, spread
from ..calibration.stats import GroupStats, LayerStats
from ..formats.modelopt_nvfp4.numerics import global_scale, input_scale, quantize_nvfp4
from ..gptq.solver import error_ratio, row_weighted_errors, weighted_error
from ..model.config import SalaConfig
from ..model.layout import FUSED_OF, FUSED_PARAMETERS, input_groups
from ..model.modeling import DecoderLayer
from ..serving import PLAIN_DTYPE
from ..settings import defaults, smoothing_for
from ..smooth.fold import fold_scales, smooth_scales, smoothable, transform_hessian
from .gptq import gptq_nvfp4
from .input_scale import INPUT_SCALE_RULES, InputScaleSearch, search_stride
from .plan import NVFP4Plan
from .search import search_block_scales, searched_global_scale

_DEFAULTS = defaults("nvfp4")
_SMOOTH = smoothing_for(_DEFAULTS)
ROUNDINGS = ("nearest", "gptq")
HESSIAN_SUM = "samples"
"""The input Hessian GPTQ rounding solves with: every calibration sample weighs the same (GPTQ's default)."""
_TINY = torch.finfo(torch.float32).tiny  # an all-zero weight gets a positive global scale, not 0/0 block scales


@dataclass(frozen=True)
class NVFP4LayerOptions:
    """The NVFP4 settings of one layer; defaults are ``salaquant.settings``'."""

    mse_iters: int = _DEFAULTS.nvfp4.mse_iters  # 0: plain block scales
    mse_max_shrink: float = _DEFAULTS.nvfp4.mse_max_shrink
    mse_max_grow: float = _DEFAULTS.nvfp4.mse_max_grow
    smooth_alpha: float | None = _SMOOTH[0]  # None: no smoothing
    smooth_groups: tuple[str, ...] = _SMOOTH[1]
    input_scale: str = _DEFAULTS.nvfp4.input_scale  # "max" (ModelOpt's rule) or "mse"
    rounding: str = _DEFAULTS.nvfp4.rounding  # "nearest" or "gptq" (column sweep with error feedback, ``gptq.py``)
    static_scales: bool = _DEFAULTS.nvfp4.static_scales  # gptq: block scales before the sweep (else during it)

    @property
    def needs_hessian(self) -> bool:
        return self.rounding == "gptq"


def _weighted_error(w: torch.Tensor, w_hat: torch.Tensor, importance: torch.Tensor) -> float:
    return float(((w.double() - w_hat.double()) ** 2 * importance.double()[None, :]).sum())


class NVFP4LayerQuantizer:
    def __init__(
        self,
        config: SalaConfig,
        plan: NVFP4Plan,
        options: NVFP4LayerOptions,
        calibration_tokens: int = 0,
        ranks: Ranks = SINGLE,
    ) -> None:
        """``calibration_tokens``: the tokens every layer sees (sets the ``mse`` input-scale search's stride);
        ``ranks``: the processes the linears' quantization is spread over."""
        if options.mse_iters < 0 or not 0.0 <= options.mse_max_shrink < 1.0 or not options.mse_max_grow >= 1.0:
            raise ValueError("--mse-iters must be >= 0, --mse-max-shrink in [0, 1) and --mse-max-grow >= 1")
        if options.input_scale not in INPUT_SCALE_RULES:
            raise ValueError(f"--input-scale {options.input_scale!r}: expected {' or '.join(INPUT_SCALE_RULES)}")
        if options.rounding not in ROUNDINGS:
            raise ValueError(f"--rounding {options.rounding!r}: expected {' or '.join(ROUNDINGS)}")
        self.config = config
        self.plan = plan
        self.opts = options
        self.stride = search_stride(calibration_tokens)
        self.ranks = ranks

    @torch.no_grad()
    def smooth(
        self,
        index: int,
        layer: DecoderLayer,
        stats: LayerStats,
        report: dict[str, Any] | None = None,
        folded: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Fold SmoothQuant scales into the layer's groups whose members are all quantized; returns each
        group's per-channel (absmax, mean x^2) as seen by the smoothed linears (``folded`` receives the scales)."""
        prefix = f"model.layers.{index}."
        act: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for g in input_groups(self.config, layer.kind):
            st = stats[g.name]
            absmax, msq = st.absmax.float(), st.mean_sq()
            members_q = [prefix + m in self.plan.quantized for m in g.members]
            if (
                self.opts.smooth_alpha is not None
                and all(members_q)
                and smoothable(g)
                and g.name in self.opts.smooth_groups
            ):
                s = smooth_scales(
                    msq.sqrt(), [layer.get_submodule(m).weight for m in g.members], self.opts.smooth_alpha
                )
                fold_scales(layer, g, s)
                s = s.to(absmax.device)
                absmax, msq = absmax / s, msq / s**2
                if report is not None:
                    report[g.name] = float(s.max() / s.min())
                if folded is not None:
                    folded[g.name] = s
            act[g.name] = (absmax, msq)
        return act

    @torch.no_grad()
    def _quantize_linear(
        self,
        name: str,
        mod: nn.Module,
        ws2: torch.Tensor | None,
        msq: torch.Tensor,
        in_scale: torch.Tensor,
        hessian: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One linear's NVFP4 tensors (and ``dequantized``, what the layer propagates with) and report entry;
        ``hessian`` (the smoothed inputs') for GPTQ rounding."""
        w = mod.weight.data.float()
        ws2 = self._global_scale(w.abs().amax().clamp(min=_TINY)) if ws2 is None else ws2
        t0 = time.perf_counter()
        plain = quantize_nvfp4(w, weight_scale_2=ws2)
        err_plain = _weighted_error(w, plain.dequantize(), msq)
        q = plain
        static = hessian is None or self.opts.static_scales  # block scales chosen before any rounding
        if self.opts.mse_iters > 0 and static:  # (GPTQ with scales during the sweep searches them there)
            found = search_block_scales(
                w, ws2, msq, self.opts.mse_iters, self.opts.mse_max_shrink, self.opts.mse_max_grow
            )
            q = quantize_nvfp4(w, weight_scale_2=ws2, block_scale=found.scales)
        if hessian is not None:
            solved = gptq_nvfp4(
                w,
                hessian.to(w.device),
                ws2,
                msq,
                block_scale=(q.weight_scale if self.opts.static_scales else None),
                mse_iters=self.opts.mse_iters,
                mse_max_shrink=self.opts.mse_max_shrink,
                mse_max_grow=self.opts.mse_max_grow,
            )
            q = solved.weight
        if w.is_cuda:
            torch.cuda.synchronize(w.device)
        seconds = time.perf_counter() - t0
        w_hat = q.dequantize()
        err = _weighted_error(w, w_hat, msq)
        total = _weighted_error(w, torch.zeros_like(w), msq)
        tensors = {
            "dequantized": w_hat,
            "weight": q.weight,
            "weight_scale": q.weight_scale,
            "weight_scale_2": q.weight_scale_2.reshape(()).float().clone(),
            "input_scale": in_scale.reshape(()).float().clone(),
        }
        entry = {
            "format": "nvfp4",
            "rel_err": err / total if total > 0 else 0.0,
            "rel_err_plain_scales": err_plain / total if total > 0 else 0.0,
            "seconds": seconds,
        }
        if hessian is not None:  # the objective GPTQ minimises, against rounding to nearest under the same scales
            h = hessian.to(w.device)
            total_h = float(row_weighted_errors(w, None, h).sum())
            entry["hessian_rel_err"] = error_ratio(solved.loss, total_h)  # the solver's loss: no second product
            nearest = quantize_nvfp4(w, weight_scale_2=ws2, block_scale=q.weight_scale)
            entry["hessian_rel_err_nearest"] = error_ratio(weighted_error(w, nearest.dequantize(), h), total_h)
        return tensors, {name: entry}

    def _global_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The weight's global scale: ModelOpt's, with the search's room for grown block scales when it runs."""
        return searched_global_scale(amax, self.opts.mse_max_grow) if self.opts.mse_iters > 0 else global_scale(amax)

    @staticmethod
    def _hessian(stats: GroupStats, smoothing: torch.Tensor | None) -> torch.Tensor:
        """The group's input Hessian as the (smoothed) linears see it."""
        h = stats.hessian_per_sample() if HESSIAN_SUM == "samples" else stats.hessian_mean()
        return transform_hessian(h, smoothing.to(h.device)) if smoothing is not None else h

    @torch.no_grad()
    def quantize_layer(self, index: int, layer: DecoderLayer, stats: LayerStats) -> LayerResult:
        prefix = f"model.layers.{index}."
        report: dict[str, Any] = {"layer": index, "kind": layer.kind, "linears": {}, "smooth_scale_range": {}}
        tensors: dict[str, torch.Tensor] = {}
        folded: dict[str, torch.Tensor] = {}
        act = self.smooth(index, layer, stats, report["smooth_scale_range"], folded)

        shared_ws2: dict[str, torch.Tensor] = {}
        for fused, ms in FUSED_PARAMETERS.items():
            if all(prefix + m in self.plan.quantized for m in ms):
                amax = torch.stack([layer.get_submodule(m).weight.detach().float().abs().amax() for m in ms]).amax()
                shared_ws2[fused] = self._global_scale(amax.clamp(min=_TINY))

        searches: dict[str, tuple[InputScaleSearch, list[str]]] = {}
        jobs: list[Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]]] = []
        costs: list[float] = []
        for g in input_groups(self.config, layer.kind):
            absmax, msq = act[g.name]
            in_scale = input_scale(absmax.amax())
            hessian = self._hessian(stats[g.name], folded.get(g.name)) if self.opts.needs_hessian else None
            quantized = [m for m in g.members if prefix + m in self.plan.quantized]
            if quantized and self.opts.input_scale == "mse":
                searches[g.name] = (InputScaleSearch(in_scale, self.stride), quantized)
            for m in g.members:
                mod = layer.get_submodule(m)
                if prefix + m not in self.plan.quantized:
                    tensors[f"{m}.weight"] = mod.weight.data.to(PLAIN_DTYPE).cpu()
                    report["linears"][m] = {"format": "bf16"}
                    continue
                ws2 = shared_ws2.get(FUSED_OF.get(m, ""))
                jobs.append(partial(self._quantize_linear, m, mod, ws2, msq, in_scale, hessian))
                costs.append(
                    mod.weight.numel() * (1 + self.opts.mse_iters + (msq.numel() if hessian is not None else 0))
                )
        # Each linear is quantized on one process (the costliest first, to the least loaded), its results go to all.
        for got, entry in spread(jobs, costs, self.ranks):
            name = next(iter(entry))
            report["linears"].update(entry)
            mod = layer.get_submodule(name)
            mod.weight.data = got.pop("dequantized").to(mod.weight.device, mod.weight.dtype)
            tensors.update({f"{name}.{k}": v.cpu() for k, v in got.items()})
        for name, module in layer.named_modules():
            if name.endswith("norm") and hasattr(module, "weight"):
                tensors[f"{name}.weight"] = module.weight.data.to(PLAIN_DTYPE).cpu()
        result = LayerResult(layer=layer, tensors=tensors, report=report)
        if searches:
            result.observe = {members[0]: search for search, members in searches.values()}

            def finish(totals: dict[str, Any]) -> None:
                report["input_scale"] = {}
                for group, (_, members) in searches.items():
                    search = totals[members[0]]
                    chosen = search.scale().float().cpu()
                    for m in members:
                        tensors[f"{m}.input_scale"] = chosen.clone()
                    report["input_scale"][group] = search.report()

            result.finish = finish
        return result
