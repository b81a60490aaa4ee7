"""Calibration-engine benchmark: statistics collection over a long-context mix at a given model shape.

Builds a random checkpoint of the preset's shape (``full`` = the real 9.48B MiniCPM-SALA) unless one is
given, runs the engine (forced dense, Hessians of every input group) over a calibration mix that holds one
sample of ``--long`` tokens plus ``--short-count`` samples of ``--short`` tokens, and prints tokens/s,
time per layer type, peak GPU memory, peak CPU RSS and the FLOP floor of the same work. Writes JSON.

  python benchmarks/calibration.py --preset full --out OUT            # on the H200
  python benchmarks/calibration.py --preset tiny --long 600 --short 64 --out /tmp/b   # smoke, CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import time
from pathlib import Path

import torch
from common import work_flops

from salaquant.calibration.contract import EngineOptions
from salaquant.calibration.engine import CalibrationEngine
from salaquant.model.config import SalaConfig
from salaquant.model.tiny import preset_config, write_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--model", type=Path, help="an existing checkpoint (skips the random one)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-bench"))
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--short", type=int, default=8192)
    ap.add_argument("--short-count", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 rate used for the floor")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict[str, object] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    if args.model is None:
        args.model = args.scratch / f"random-{args.preset}"
        if not (args.model / "config.json").exists():
            t0 = time.perf_counter()
            write_random_checkpoint(args.model, preset_config(args.preset), seed=0, device=dev, overwrite=True)
            res["write_checkpoint_s"] = round(time.perf_counter() - t0, 1)
    cfg = SalaConfig.from_file(args.model)
    g = torch.Generator().manual_seed(0)
    lengths = [args.long] + [args.short] * args.short_count
    samples = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    work = args.scratch / "work"
    shutil.rmtree(work, ignore_errors=True)
    opts = EngineOptions(
        device=dev,
        chunk_tokens=args.chunk_tokens,
        tf32=args.tf32,
        show_progress=False,
        propagate="float",
        save_hessians=False,
    )
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = CalibrationEngine(args.model, samples, work, opts)
    t0 = time.perf_counter()
    result = engine.run()
    wall = time.perf_counter() - t0
    tokens = sum(lengths)
    flops = work_flops(cfg, lengths, hessian=True)
    floor = flops["total"] / (args.peak_tflops * 1e12)
    per_kind: dict[str, list[float]] = {}
    for _, kind, sec in result.layer_seconds:
        per_kind.setdefault(kind, []).append(sec)
    res.update(
        {
            "preset": args.preset,
            "samples": len(lengths),
            "lengths": lengths,
            "tokens": tokens,
            "chunk_tokens": args.chunk_tokens,
            "tf32": args.tf32,
            "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
            "seconds_per_layer": {k: round(sum(v) / len(v), 3) for k, v in per_kind.items()},
            "phase_seconds": {k: round(v, 2) for k, v in result.timings.items()},
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
            "peak_cpu_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "hidden_state_gib": round(tokens * cfg.hidden_size * 2 / 2**30, 2),
            "flops": {k: f"{v:.3e}" for k, v in flops.items()},
            "flop_floor_s": round(floor, 2),
            "fraction_of_floor": round(floor / wall, 3),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"calibration-{args.preset}.json").write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
