"""The damage of each option, measured: KL(source || changed) of the final logits on a few calibration windows
when one unit alone takes the option and every other linear stays as in the source.

The windows run through the model layer by layer (one layer on the device at a time, as in the calibration
engine, dense attention). At layer ``i`` every option of every unit of that layer starts a changed copy of the
hidden states (the layer run with that unit's weights replaced by what ``perturb`` gives); the copies started
at earlier layers go through layer ``i`` as it is. After the last layer each copy's logits are compared with the
source's: the mean per-token KL over the windows is that option's cost. The unchanged option (the unit's last,
its linears as in the source) costs 0 and is not run. Work: every changed copy goes through the layers after its
own, about half the model per option on ``windows x seq_len`` tokens, and the copies' hidden states stay on the
device (``options x windows x seq_len x hidden`` values).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..io.reader import CheckpointReader
from ..model.config import SalaConfig
from ..model.layers import rms_norm
from ..model.loading import CheckpointParts
from ..model.modeling import DecoderLayer, layer_rope, lm_logits
from ..runtime.load import use_layer_kernels
from .size import Unit

Perturb = Callable[[Unit, str, DecoderLayer], dict[str, torch.Tensor]]
"""``(unit, option, layer)`` -> the weight each member of the unit takes under that option (same shapes)."""


def search_windows(samples: Sequence[torch.Tensor], windows: int, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` token windows cut from the calibration samples in order (their tokens concatenated), as
    many as ``windows`` when the samples hold that many, at least one: ValueError when they hold less."""
    ids = torch.cat([s.reshape(-1) for s in samples])
    n = min(windows, ids.numel() // seq_len)
    if n < 1:
        raise ValueError(
            f"the calibration samples hold {ids.numel()} tokens, fewer than one search window of {seq_len}: "
            "lower the search window length or give more calibration text"
        )
    return ids[: n * seq_len].view(n, seq_len)


def compute_dtype(reader: CheckpointReader, device: torch.device) -> torch.dtype:
    """The stored dtype on a GPU (as the calibration runs), float32 on a CPU (exact enough to see 8-bit damage)."""
    return reader.dtype("model.embed_tokens.weight") if device.type == "cuda" else torch.float32


def _embedded(source: CheckpointParts, ids: torch.Tensor) -> torch.Tensor:
    embed = source.tensor("model.embed_tokens.weight")
    return nn.functional.embedding(ids, embed) * source.config.scale_emb


def _log_probs(source: CheckpointParts):
    """``h [B, T, hidden]`` after the last layer -> fp32 log-probabilities, with the checkpoint's norm and head."""
    config = source.config
    norm = source.tensor("model.norm.weight")
    head = source.tensor("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")

    def log_probs(x: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(x, norm, config.rms_norm_eps)
        return torch.log_softmax(lm_logits(config, lambda v: nn.functional.linear(v, head), normed), dim=-1)

    return log_probs


def _kl_sum(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Summed KL(reference || other) over the positions of two log-probability tensors."""
    return float((reference.exp() * (reference - other)).sum())


@torch.no_grad()
def measure_costs(
    reader: CheckpointReader,
    config: SalaConfig,
    ids: torch.Tensor,
    units: Sequence[Unit],
    perturb: Perturb,
    device: torch.device,
    on_layer: Callable[[int, int, float], None] | None = None,
    parts: dict[str, float] | None = None,
) -> list[list[float]]:
    """The cost of every option of every unit (``units[u].options[k]`` -> ``result[u][k]``), as described above.
    ``on_layer(layer, copies, seconds)`` is told after each layer; ``parts`` gets the seconds spent loading layers,
    in the probe (``perturb``), in the layers' forwards and in the final logits and KL."""
    clock = _PartClock(device, parts if parts is not None else {})
    dtype = compute_dtype(reader, device)
    ids = ids.to(device)
    source = CheckpointParts(reader, config, device, dtype)
    h = _embedded(source, ids)
    by_layer: dict[int, list[int]] = {}
    for u, unit in enumerate(units):
        by_layer.setdefault(unit.layer, []).append(u)
    copies: list[tuple[int, int, torch.Tensor]] = []  # (unit, option, hidden states)
    t = ids.shape[1]
    for i in range(config.num_hidden_layers):
        t0 = time.perf_counter()
        layer = source.layer(i)
        use_layer_kernels(layer)
        rope = layer_rope(config, layer.kind, 0, t, device)
        clock.lap("load")
        copies = [(u, k, layer(x, rope, None, "dense")) for u, k, x in copies]
        for u in by_layer.get(i, []):
            unit = units[u]
            mods = {m: layer.get_submodule(m) for m in unit.members}
            kept = {m: mod.weight.data for m, mod in mods.items()}
            for k, option in enumerate(unit.options[:-1]):
                clock.lap("forward")
                changed = {m: w.to(device, dtype) for m, w in perturb(unit, option, layer).items()}
                clock.lap("probe")
                for m, w in changed.items():
                    mods[m].weight.data = w
                copies.append((u, k, layer(h, rope, None, "dense")))
                for m, mod in mods.items():
                    mod.weight.data = kept[m]
        h = layer(h, rope, None, "dense")
        del layer
        clock.lap("forward")
        if on_layer is not None:
            on_layer(i, len(copies), time.perf_counter() - t0)
    log_probs = _log_probs(source)
    reference = [log_probs(x[None]) for x in h]  # per window: the logits of all copies are never held at once
    costs = [[0.0] * len(unit.options) for unit in units]
    for u, k, x in copies:
        kl = sum(_kl_sum(ref, log_probs(row[None])) for ref, row in zip(reference, x, strict=True))
        costs[u][k] = max(kl, 0.0) / ids.numel()
    clock.lap("logits_and_kl")
    return costs


class _PartClock:
    """Seconds between successive ``lap`` calls, added to ``parts[name]`` (the device synchronized at each lap, so
    GPU work is counted in the part that launched it)."""

    def __init__(self, device: torch.device, parts: dict[str, float]) -> None:
        self.device, self.parts, self.last = device, parts, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.last
        self.last = now


@torch.no_grad()
def export_kl(
    source: Path, export: Path, ids: torch.Tensor, device: torch.device, on_layer: Callable[[int], None] | None = None
) -> float:
    """Mean per-token KL(source || export) of the final logits on ``ids`` (dense attention), both checkpoints run
    layer by layer (the export's linears dequantized, as the costs were measured); ``on_layer(i)`` is told after
    each layer."""
    readers = [CheckpointReader(source), CheckpointReader(export)]
    try:
        config = SalaConfig.from_dict(readers[0].config())
        dtype = compute_dtype(readers[0], device)
        ids = ids.to(device)
        sources = [CheckpointParts(r, config, device, dtype) for r in readers]
        hs = [_embedded(source, ids) for source in sources]
        for i in range(config.num_hidden_layers):
            for j, source in enumerate(sources):
                layer = source.layer(i)
                use_layer_kernels(layer)
                hs[j] = layer(hs[j], layer_rope(config, layer.kind, 0, ids.shape[1], device), None, "dense")
            if on_layer is not None:
                on_layer(i)
        fns = [_log_probs(source) for source in sources]
        kl = sum(_kl_sum(fns[0](a[None]), fns[1](b[None])) for a, b in zip(hs[0], hs[1], strict=True))
        return max(kl, 0.0) / ids.numel()
    finally:
        for r in readers:
            r.close()
