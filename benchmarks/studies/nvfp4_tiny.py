"""NVFP4 variants on the shipped tiny model: held-out perplexity, KL and top-1 agreement vs bf16.

Every variant goes through ``salaquant nvfp4`` (calibration engine, export, checker); the export is read back
by the project's loader (weights dequantized; activations stay bf16, i.e. the weight-only FP4 path Hopper
GPUs serve) and scored on the first 16 x 1024 held-out tokens, dense attention, CPU.

  python benchmarks/studies/nvfp4_tiny.py --out OUT [--max-samples 32 --max-len 2048]
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from scoring import CALIB, MODEL, Variant, run_benchmark

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions

OPTIONS: dict[str, tuple[NVFP4LayerOptions, bool]] = {
    "NVFP4 default, plain scales": (NVFP4LayerOptions(mse_iters=0, rounding="nearest"), False),
    "NVFP4 default, block-scale search": (NVFP4LayerOptions(rounding="nearest"), False),
    "NVFP4 dense-all, plain scales": (NVFP4LayerOptions(mse_iters=0, rounding="nearest"), True),
    "NVFP4 dense-all, block-scale search": (NVFP4LayerOptions(rounding="nearest"), True),
    "NVFP4 dense-all, search, no smoothing": (NVFP4LayerOptions(smooth_alpha=None, rounding="nearest"), True),
}


def variant(opts: NVFP4LayerOptions, dense_all: bool):
    def quantize(out: Path, calib: CalibOptions, console: Console) -> object:
        run = NVFP4RunOptions(dense_all=dense_all, device="cpu", show_progress=False, overwrite=True)
        return run_method(MODEL, out, [str(CALIB)], calib, NVFP4Method(opts, run), console)

    return quantize


VARIANTS: list[Variant] = [(name, variant(*spec)) for name, spec in OPTIONS.items()]

if __name__ == "__main__":
    run_benchmark(__doc__ or "", VARIANTS, "nvfp4_tiny.json")
