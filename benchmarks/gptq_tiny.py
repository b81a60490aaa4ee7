"""GPTQ W4A16 variants on the shipped tiny model: held-out perplexity, KL and top-1 agreement vs bf16.

Every variant goes through ``salaquant gptq`` (calibration engine, export, checker); the exported checkpoint
is read back by the project's loader (GPTQ tensors dequantized exactly as the serving kernels do) and
evaluated on the first 16 x 1024 held-out tokens, dense attention, CPU.

  python benchmarks/gptq_tiny.py --out OUT [--max-samples 32 --max-len 2048]
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from tiny_quality import CALIB, MODEL, Variant, run_benchmark

from salaquant.calibration import CalibOptions
from salaquant.gptq.command import RunOptions, run_gptq
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions

OPTIONS: dict[str, GPTQLayerOptions] = {
    "RTN w4 g128": GPTQLayerOptions(method="rtn", smooth_alpha=None),
    "GPTQ w4 g128, no smoothing": GPTQLayerOptions(smooth_alpha=None),
    "GPTQ w4 g128, SmoothQuant 0.5 (default)": GPTQLayerOptions(),
    "GPTQ w4 g128, SmoothQuant 0.5, act-order": GPTQLayerOptions(act_order=True),
    "GPTQ w4 g128, SmoothQuant 0.5, MSE scales": GPTQLayerOptions(mse=True),
}


def variant(opts: GPTQLayerOptions):
    def quantize(out: Path, calib: CalibOptions, console: Console) -> object:
        run = RunOptions(device="cpu", show_progress=False, overwrite=True)
        return run_gptq(MODEL, out, [CALIB], calib, BitsOptions(), opts, run, console)

    return quantize


VARIANTS: list[Variant] = [(name, variant(opts)) for name, opts in OPTIONS.items()]

if __name__ == "__main__":
    run_benchmark(__doc__ or "", VARIANTS, "gptq_tiny.json")
