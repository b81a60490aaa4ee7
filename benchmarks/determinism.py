"""Whether a quantizer gives the same bytes run after run, and where two runs first part if not.

Runs ``salaquant gptq`` (or ``nvfp4``) ``--runs`` times in this process on the random-weight checkpoint and
calibration mix of ``pipeline.py`` (same options), and records per decoder layer:

* ``inputs``: a checksum of the hidden states the layer reads (every sample's bits, after the device finished
  writing them), so a difference made by the propagation through the layer before shows here first;
* ``weights``: a checksum of the layer's float weights as loaded (before smoothing and the solve);
* ``stats``: per input group, checksums of the statistics the quantizer receives (``xtx``, ``xtx_per_sample``,
  ``absmax``, ``sumsq``): a difference made by the statistics pass shows here with equal ``inputs``;
* ``export``: the sha256 of the layer's tensors in the export (``pipeline.run_quantizer``'s ``layer_sha256``): a
  difference made by the solve shows here with equal ``stats``.

Then ``first_difference`` names, for each later run against the first, the first layer at which each record
differs. Checksums are sums of the tensors' bit patterns as integers: any change of one value changes them. The
checks synchronise the device before each layer and add a few seconds a run, so the runs' timings are not the
pipeline's.

  python benchmarks/determinism.py --out OUT --runs 2                      # full shape on a GPU
  python benchmarks/determinism.py --out /tmp/d --preset tiny --long 300 --short 64 --short-count 2   # CPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pipeline import QuantRun, prepare_inputs, run_quantizer

from salaquant.calibration.engine import CalibrationEngine
from salaquant.gptq.layer import GPTQLayerQuantizer
from salaquant.nvfp4.layer import NVFP4LayerQuantizer

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements' bit patterns read as signed integers (int64 arithmetic, wrapping)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    as_int = flat.view(_INT_VIEW[flat.element_size()]) if flat.is_floating_point() else flat
    return int(as_int.sum(dtype=torch.int64))


def hidden_checksum(hs: list[torch.Tensor], device: torch.device | str = "cpu") -> str:
    """One digest of a pass's hidden states: the sha256 of every sample's bit checksum, in sample order (each
    sample summed on ``device``: on a GPU a copy there and its sum take a fraction of the CPU's time)."""
    sums = [bit_checksum(h.to(device)) for h in hs]
    return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def stats_checksums(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per input group, the bit checksum of each statistic a quantizer reads."""
    out: dict[str, dict[str, int]] = {}
    for name, st in sorted(stats.items()):
        fields = {"xtx": st.xtx, "xtx_per_sample": st.xtx_per_sample, "absmax": st.absmax, "sumsq": st.sumsq}
        out[name] = {k: bit_checksum(v) for k, v in fields.items() if v is not None}
    return out


@contextmanager
def recording(log: dict[int, dict[str, Any]]) -> Iterator[None]:
    """Patch the engine's per-layer step and both layer quantizers to fill ``log[layer]`` while the block runs."""
    engine_layer = CalibrationEngine._layer
    quantizers: list[tuple[type, Callable[..., Any]]] = [
        (cls, cls.quantize_layer) for cls in (GPTQLayerQuantizer, NVFP4LayerQuantizer)
    ]

    def layer_step(self: CalibrationEngine, i: int, hs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.setdefault(i, {})["inputs"] = hidden_checksum(hs, self.device)
        return engine_layer(self, i, hs, *args, **kwargs)

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def quantize_layer(self: Any, index: int, layer: torch.nn.Module, stats: dict[str, Any]) -> Any:
            entry = log.setdefault(index, {})
            weights = {n: bit_checksum(p) for n, p in sorted(layer.named_parameters())}
            entry["weights"] = hashlib.sha256(json.dumps(weights).encode()).hexdigest()[:16]
            entry["stats"] = stats_checksums(stats)
            return original(self, index, layer, stats)

        return quantize_layer

    CalibrationEngine._layer = layer_step  # type: ignore[method-assign]
    for cls, original in quantizers:
        cls.quantize_layer = wrap(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        CalibrationEngine._layer = engine_layer  # type: ignore[method-assign]
        for cls, original in quantizers:
            cls.quantize_layer = original  # type: ignore[method-assign]


def first_difference(runs: list[dict[str, Any]]) -> list[dict[str, int | None]]:
    """For each run after the first: per record kind, the first layer whose record differs from the first run's
    (None: none does)."""
    base = runs[0]["layers"]
    out: list[dict[str, int | None]] = []
    for run in runs[1:]:
        found: dict[str, int | None] = {}
        for kind in ("inputs", "weights", "stats", "export"):
            differing = [int(i) for i in base if base[i].get(kind) != run["layers"].get(i, {}).get(kind)]
            found[kind] = min(differing, default=None)
        out.append(found)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--method", choices=["gptq", "nvfp4"], default="gptq")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-determinism"))
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--short", type=int, default=8192)
    ap.add_argument("--short-count", type=int, default=40)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error("--runs must be at least 2: the point is to compare runs")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, calib, lengths, _ = prepare_inputs(args, device)
    runs: list[dict[str, Any]] = []
    for k in range(args.runs):
        log: dict[int, dict[str, Any]] = {}
        job = QuantRun(args.method, model, calib, args.scratch / f"export-{k}", max(lengths))
        with recording(log):
            row = run_quantizer(job, device)
        for layer, digest in row["layer_sha256"].items():
            if layer != "-1":
                log.setdefault(int(layer), {})["export"] = digest
        shutil.rmtree(job.out, ignore_errors=True)
        runs.append({"wall_s": row["wall_s"], "layers": {str(i): log[i] for i in sorted(log)}})
        print(f"run {k}: {row['wall_s']} s", flush=True)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "method": args.method,
        "calibration_lengths": lengths,
        "first_difference": first_difference(runs),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"determinism-{args.method}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["first_difference"]), f"wrote {path}", sep="\n")


if __name__ == "__main__":
    main()
