"""What the engine and a method's layer quantizer exchange: the engine's options, the quantizer protocol, what it
returns per layer (`LayerResult`, with observers of inputs it still wants to see) and the run's `EngineResult`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file
from torch import nn

from ..model.modeling import DecoderLayer
from ..settings import defaults
from .stats import HESSIAN_SUMS, LayerStats

_DEFAULTS = defaults("gptq")  # the engine section is the same for every method


@dataclass
class EngineOptions:
    """Settings of the calibration engine. Everything here except ``device``, ``show_progress``, ``pin_memory``,
    ``background_writes`` and ``resume_every`` enters the resume fingerprint."""

    device: str = _DEFAULTS.engine.device
    chunk_tokens: int = _DEFAULTS.engine.chunk_tokens
    attention_mode: str = "dense"
    propagate: str = _DEFAULTS.engine.propagate  # or "float": next layer sees the float layer's outputs
    hessian: bool = True
    hessian_dtype: str = "fp32"  # or "fp64"
    hessian_sums: tuple[str, ...] = HESSIAN_SUMS  # the Hessian sums kept: a quantizer needs only its weighting's
    tf32: bool = False  # TF32 for fp32 activations too (~1e-3 relative error); 16-bit ones always use it, exactly
    save_hessians: bool = True  # statistics-only runs: persist X^T X per layer (d^2 floats per group)
    show_progress: bool = True
    pin_memory: bool = True
    background_writes: bool = True  # write layer i's files while layer i + 1 computes
    attention_kernels: bool = True  # GLA through salaquant.kernels (Triton on CUDA, the reference elsewhere)
    resume_every: int | None = None  # resume point (hidden states) every N layers and at the last; None: by device

    def fingerprint_fields(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("device", "show_progress", "pin_memory", "background_writes", "resume_every"):
            d.pop(key)
        return d


class Observer(Protocol):
    """A sum over the inputs of one module (``LayerResult.observe``)."""

    def update(self, x: torch.Tensor) -> None: ...
    def fresh(self) -> Observer: ...  # an empty one of the same kind
    def merge(self, other: Any) -> Observer: ...  # adds ``other`` into this one, returns it
    def tensors(self) -> list[torch.Tensor]: ...  # every sum, in a fixed order


@dataclass
class LayerResult:
    """What a quantizer returns for one layer."""

    layer: nn.Module | None  # module to propagate through (None: the float layer)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # persisted in the work folder
    report: dict[str, Any] = field(default_factory=dict)  # json-able
    # Inputs the quantizer still wants to see: module name in the layer -> an observer of that module's input on
    # every chunk of the pass through ``layer`` (the propagation pass; with float propagation, one extra pass whose
    # outputs are dropped). Each leaf of samples is seen by its own ``fresh()`` copy; the leaves' observers are
    # added in the statistics tree (and across processes), and ``finish`` gets the totals after that pass: it may
    # complete ``tensors`` and ``report``.
    observe: dict[str, Observer] = field(default_factory=dict)
    finish: Callable[[dict[str, Observer]], None] | None = None


class LayerQuantizer(Protocol):
    def quantize_layer(self, index: int, layer: DecoderLayer, stats: LayerStats) -> LayerResult: ...


@dataclass
class EngineResult:
    work_dir: Path
    num_layers: int
    reports: list[dict[str, Any]]
    timings: dict[str, float]
    tokens: int
    layer_seconds: list[tuple[int, str, float]] = field(default_factory=list)  # layers run in this call
    rank_tokens: list[int] = field(default_factory=list)  # calibration tokens each process held
    rank_peaks: list[dict[str, float | None]] = field(default_factory=list)  # each process's peak GPU memory, RSS
    # torch's CPU threads in this process: CPU sums split by thread, so a CPU run's bytes are those of any run with
    # as many threads per process, whatever the number of processes
    cpu_threads: int = 1

    def layer_tensors(self, index: int) -> dict[str, torch.Tensor]:
        path = self.work_dir / "layers" / f"{index:03d}.safetensors"
        return load_file(path) if path.exists() else {}
