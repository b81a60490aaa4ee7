"""Decode speed of the runtime at the real 9.48B shape: bf16, GPTQ W4A16 and NVFP4 exports of one random model.

Writes a random-weight checkpoint of the preset's shape (``full``: the published MiniCPM-SALA configuration),
exports it with ``salaquant gptq --method rtn`` and ``salaquant nvfp4 --mse-iters 0`` on one short calibration
sample (the decode speed depends on the format, not on how the weights were chosen), then loads the source and
each export with ``salaquant.runtime.load`` and generates greedily after a ``--prompt``-token prompt: one warm-up
call (the kernels compile), then the time to the first token (prefill) and the decode rate of the
``--new-tokens`` that follow. bf16 is the peer measured in the same run. Prints a table and writes JSON.

  python benchmarks/runtime.py --out OUT                      # H200: full shape, 512-token prompt, 64 tokens
  python benchmarks/runtime.py --out /tmp/r --preset tiny --prompt 32 --new-tokens 8 --device cpu   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from results import write_results
from rich.console import Console
from rich.table import Table

from salaquant.calib_data import CalibOptions
from salaquant.gptq.command import RunOptions, run_gptq
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.nvfp4.command import NVFP4RunOptions, run_nvfp4
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.load import load

ROOT = Path(__file__).resolve().parents[1]
CALIB = ROOT / "calib" / "sala-tiny-calib.jsonl"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exports(source: Path, scratch: Path, device: str) -> dict[str, Path]:
    """The GPTQ W4A16 g128 and NVFP4 (SGLang's exclusions) exports of ``source``, from one 128-token sample."""
    console = Console(quiet=True)
    calib = CalibOptions(max_samples=1, max_len=128)
    gptq = run_gptq(
        source,
        scratch / "gptq",
        [str(CALIB)],
        calib,
        BitsOptions(),
        GPTQLayerOptions(method="rtn"),
        RunOptions(device=device, show_progress=False),
        console,
    )
    nvfp4 = run_nvfp4(
        source,
        scratch / "nvfp4",
        [str(CALIB)],
        calib,
        NVFP4LayerOptions(mse_iters=0, smooth_alpha=None),
        NVFP4RunOptions(device=device, show_progress=False),
        console,
    )
    return {"GPTQ W4A16": gptq, "NVFP4": nvfp4}


def decode_speed(path: Path, device: str, prompt: int, new_tokens: int, vocab: int) -> dict[str, float]:
    """Load time, then (after one warm-up call) the first token's latency and the decode rate of one greedy run."""
    t0 = time.perf_counter()
    model = load(path, device=device)
    _sync(device)
    loaded = time.perf_counter() - t0
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    model.greedy(ids, 4)
    _sync(device)
    warm_up = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.greedy(ids, 1)
    _sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.greedy(ids, new_tokens + 1)
    _sync(device)
    total = time.perf_counter() - t0
    assert out.shape[1] == prompt + new_tokens + 1, out.shape
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    decode = max(total - first, 1e-9)
    return {
        "load_s": round(loaded, 2),
        "warm_up_s": round(warm_up, 2),
        "first_token_ms": round(1000 * first, 1),
        "decode_tokens_per_s": round(new_tokens / decode, 2),
        "ms_per_token": round(1000 * decode / new_tokens, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-runtime"))
    args = ap.parse_args()
    shutil.rmtree(args.scratch, ignore_errors=True)
    config = preset_config(args.preset)
    t0 = time.perf_counter()
    source = write_random_checkpoint(args.scratch / "bf16", config, seed=0, device=args.device)
    paths = {"bf16": source}
    setup = {"checkpoint_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    paths.update(exports(source, args.scratch, args.device))
    setup["exports_s"] = round(time.perf_counter() - t0, 1)
    vocab = min(config["vocab_size"], 4096)  # ids the shipped tokenizer also has
    print(f"setup: {setup}", flush=True)
    rows = {}
    for name, path in paths.items():
        rows[name] = decode_speed(path, args.device, args.prompt, args.new_tokens, vocab)
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["bf16"]["decode_tokens_per_s"]
    for row in rows.values():
        row["vs_bf16"] = round(row["decode_tokens_per_s"] / base, 3)
    table = Table(title=f"runtime decode, {args.preset} shape, {args.prompt}-token prompt, {args.new_tokens} tokens")
    for col in ("export", "tokens/s", "ms/token", "vs bf16", "first token", "warm-up", "load"):
        table.add_column(col, justify="left" if col == "export" else "right")
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['decode_tokens_per_s']:.2f}",
            f"{r['ms_per_token']:.2f}",
            f"{r['vs_bf16']:.2f}x",
            f"{r['first_token_ms']:.0f} ms",
            f"{r['warm_up_s']:.1f} s",
            f"{r['load_s']:.1f} s",
        )
    Console().print(table)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "setup": setup, "rows": rows}
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    write_results(args.out, "runtime.json", result)
    shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
