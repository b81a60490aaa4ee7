"""Decode and prefill speed of the runtime at the real 9.48B shape: bf16, GPTQ W4A16 and NVFP4 exports of one model.

Writes a random-weight checkpoint of the preset's shape (``full``: the published MiniCPM-SALA configuration),
exports it with ``salaquant gptq --method rtn`` and ``salaquant nvfp4 --mse-iters 0`` on one short calibration
sample (speed depends on the format, not on how the weights were chosen), then for each format, with
``salaquant.runtime.load``:

* **batch 1** (``--context 0`` skips it) after a ``--context``-token prompt, ``--new-tokens`` greedy tokens, in one run:
  ``before`` (the model's own ``generate``: unfused projections, a growing cache, eager), ``eager`` (fused
  projections and the static cache, eager), ``graph`` (the same step replayed as a CUDA graph) and ``compiled``
  (the step compiled by ``torch.compile``, then captured); each graph is captured by a first call and timed on a
  second, and the compile and capture time is reported apart;
* **batches** ``--batches`` of ``--batch-context``-token prompts: aggregate decode tokens/s, compiled;
* **prefill** of one ``--long``-token prompt (the sparse path) and of 16 x 4,096 tokens: seconds (``--long 0``
  skips both);
* with ``--profile``, where a batch-1 decode step's GPU time goes (torch.profiler over eager steps, kernels
  grouped as GEMM / attention / norms and element-wise / other) and the host time per eager step.

Prints the tables and writes JSON.

  python benchmarks/decode.py --out OUT                      # H200: full shape
  python benchmarks/decode.py --out /tmp/d --preset tiny --context 300 --new-tokens 8 --batches 4 \\
      --batch-context 64 --long 600 --device cpu            # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import CALIB, shape_parser, write_results
from rich.console import Console
from rich.table import Table

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.decode import Decoder
from salaquant.runtime.load import load


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exports(source: Path, scratch: Path, device: str) -> dict[str, Path]:
    """The GPTQ W4A16 g128 and NVFP4 (SGLang's exclusions) exports of ``source``, from one 128-token sample."""
    console = Console(quiet=True)
    calib = CalibOptions(max_samples=1, max_len=128)
    gptq = run_method(
        source,
        scratch / "gptq",
        [str(CALIB)],
        calib,
        GPTQMethod(BitsOptions(), GPTQLayerOptions(method="rtn"), RunOptions(device=device, show_progress=False)),
        console,
    )
    nvfp4 = run_method(
        source,
        scratch / "nvfp4",
        [str(CALIB)],
        calib,
        NVFP4Method(
            NVFP4LayerOptions(mse_iters=0, smooth_alpha=None), NVFP4RunOptions(device=device, show_progress=False)
        ),
        console,
    )
    return {"GPTQ W4A16": gptq, "NVFP4": nvfp4}


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def before_rate(model: Any, prompt: torch.Tensor, new_tokens: int, device: str) -> float:
    """Tokens/s of the model's own ``generate`` after the prompt (decode only: a 1-token run is subtracted)."""
    ids = prompt[None].to(device)
    model.generate(ids, 2)  # warm-up
    first = _timed(lambda: model.generate(ids, 1), device)
    total = _timed(lambda: model.generate(ids, new_tokens + 1), device)
    return new_tokens / max(total - first, 1e-9)


def decoder_rates(dec: Decoder, prompts: list[torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """Capture / warm-up seconds from a first call, then prefill seconds and decode tokens/s (all rows) of a
    second, with the decode steps it timed and the first row's new tokens (what the rate was measured on)."""
    dec.generate(prompts, new_tokens)
    capture = dec.timings.capture
    tokens = dec.generate(prompts, new_tokens)
    t = dec.timings
    return {
        "capture_s": round(capture, 2),
        "prefill_s": round(t.prefill, 3),
        "decode_tokens_per_s": round(len(prompts) * t.steps / max(t.decode, 1e-9), 2),
        "ms_per_step": round(1000 * t.decode / max(t.steps, 1), 3),
        "steps": t.steps,
        "tokens": tokens[0].tolist(),
    }


_GROUPS = (
    ("GEMM", ("gemm", "gemv", "matmul", "mma", "w4a16", "nvfp4", "cutlass", "sm90", "xmma", "splitk", "dot")),
    ("attention", ("attention", "attn", "fmha", "flash", "gla", "softmax", "infllm", "stage")),
    ("norms / element-wise", ("elementwise", "reduce", "norm", "rsqrt", "mul", "add", "copy", "cat", "index")),
)


def profile_step(dec: Decoder, prompt: torch.Tensor, device: str, steps: int = 8) -> dict[str, Any]:
    """Where an eager batch-1 decode step's time goes after ``prompt``: GPU time by kernel group, kernels launched
    and the wall time per step (the host's share is wall minus GPU time; a graph replay removes most of it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dec.generate([prompt], steps + 2)  # sizes the static state, compiles and warms every kernel
    state, _ = dec._state(1, len(prompt) + steps + 2)
    step = dec.step_fn()
    state.cache.lengths.fill_(len(prompt))
    with torch.no_grad():  # as generate runs it: a compiled step seen with grad mode on would compile again
        wall = _timed(lambda: [step(state) for _ in range(steps)], device) / steps  # unprofiled
        state.cache.lengths.fill_(len(prompt))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                step(state)
            _sync(device)
    groups: dict[str, float] = {name: 0.0 for name, _ in _GROUPS} | {"other": 0.0}
    kernels: dict[str, float] = {}
    launches = 0
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        t = float(e.self_device_time_total)
        launches += e.count
        kernels[e.key] = kernels.get(e.key, 0.0) + t
        low = e.key.lower()
        groups[next((g for g, keys in _GROUPS if any(k in low for k in keys)), "other")] += t
    per = 1e-3 / steps  # profiler microseconds over all steps -> ms per step
    gpu_events = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    last = gpu_events[-(len(gpu_events) // steps) :]  # the last step's kernels, in launch order
    gpu = sum(groups.values()) * per
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    return {
        "wall_ms_per_step": round(1000 * wall, 3),
        "gpu_ms_per_step": round(gpu, 3),
        "host_ms_per_step": round(max(1000 * wall - gpu, 0.0), 3),
        "launches_per_step": round(launches / steps, 1),
        "groups_ms_per_step": {k: round(v * per, 3) for k, v in groups.items()},
        "top_kernels_ms_per_step": {k[:90]: round(v * per, 4) for k, v in top},
        "last_step_kernels_us": [[e.name[:80], round(float(e.device_time_total), 2)] for e in last],
    }


def batch1(model: Any, dec: Decoder, prompt: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Batch 1 after ``prompt``: eager, graph and compiled (``dec``) rates, the profiles with ``--profile``, and the
    graph breaks seen so far."""
    from torch._dynamo.utils import counters

    row: dict[str, Any] = {
        "eager": decoder_rates(Decoder(model, graphs=False), [prompt], args.new_tokens),
        "graph": decoder_rates(Decoder(model), [prompt], args.new_tokens),
        "compiled": decoder_rates(dec, [prompt], args.new_tokens),
    }
    if args.profile:
        row["profile"] = profile_step(Decoder(model), prompt, args.device)
        row["profile_compiled"] = profile_step(dec, prompt, args.device)
    row["graph_breaks"] = {str(k): v for k, v in counters["graph_break"].items()}
    return row


def measure(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    dev = args.device
    row: dict[str, Any] = {}
    prompt = _ids(args.context, vocab, 0) if args.context > 0 else None
    if prompt is not None:  # the model's own generate first, so that the two models are never loaded together
        plain = load(path, device=dev, fuse=False)
        row["before_tokens_per_s"] = round(before_rate(plain, prompt, min(args.new_tokens, 32), dev), 2)
        # the unfused model's own greedy tokens: what the static-cache decoders must reproduce
        row["before_tokens"] = plain.greedy(prompt[None].to(dev), min(args.new_tokens, 32))[
            0, prompt.numel() :
        ].tolist()
        del plain
        gc.collect()
    model = load(path, device=dev)
    dec = Decoder(model, compile=True)
    if prompt is not None:
        row |= batch1(model, dec, prompt, args)
        print(f"  batch 1: {row}", flush=True)
    row["batches"] = {}
    for b in args.batches:
        prompts = [_ids(args.batch_context, vocab, 10 + i) for i in range(b)]
        row["batches"][b] = decoder_rates(dec, prompts, args.new_tokens)
        print(f"  batch {b}: {row['batches'][b]}", flush=True)
    if args.long > 0:
        dec = Decoder(model, compile=True)
        long = _ids(args.long, vocab, 1)
        dec.generate([long], 1)
        row["prefill_long_s"] = round(dec.timings.prefill, 2)
        many = [_ids(4096 if args.preset == "full" else args.batch_context, vocab, 100 + i) for i in range(16)]
        dec.generate(many, 1)
        row["prefill_16_s"] = round(dec.timings.prefill, 2)
    del model, dec
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def batch1_table(rows: dict[str, Any], args: argparse.Namespace) -> Table:
    base = rows["bf16"]["compiled"]["decode_tokens_per_s"] if "bf16" in rows else None
    t = Table(title=f"decode at batch 1 after {args.context} tokens, {args.new_tokens} new tokens (tokens/s)")
    cols = ("export", "before", "eager", "graph", "compiled", "vs eager", "vs bf16", "compile + capture", "prefill")
    for col in cols:
        t.add_column(col, justify="left" if col == "export" else "right")
    for name, r in rows.items():
        c = r["compiled"]["decode_tokens_per_s"]
        t.add_row(
            name,
            f"{r['before_tokens_per_s']:.1f}",
            f"{r['eager']['decode_tokens_per_s']:.1f}",
            f"{r['graph']['decode_tokens_per_s']:.1f}",
            f"{c:.1f}",
            f"{c / r['eager']['decode_tokens_per_s']:.2f}x",
            f"{c / base:.2f}x" if base else "-",
            f"{r['compiled']['capture_s']:.1f} s",
            f"{r['compiled']['prefill_s']:.2f} s",
        )
    return t


def batches_table(rows: dict[str, Any], args: argparse.Namespace) -> Table:
    t = Table(title=f"aggregate decode tokens/s, {args.batch_context}-token prompts; prefill seconds")
    prefills = [f"prefill {args.long}", "prefill 16 x 4096"] if args.long > 0 else []
    for col in ("export", *[f"batch {b}" for b in args.batches], *prefills):
        t.add_column(col, justify="left" if col == "export" else "right")
    for name, r in rows.items():
        cells = [f"{r['batches'][b]['decode_tokens_per_s']:.0f}" for b in args.batches]
        if prefills:
            cells += [f"{r['prefill_long_s']:.2f}", f"{r['prefill_16_s']:.2f}"]
        t.add_row(name, *cells)
    return t


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--context", type=int, default=8192, help="Batch 1's prompt length (0: no batch-1 run).")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--batch-context", type=int, default=2048)
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--formats", nargs="*", default=["bf16", "GPTQ W4A16", "NVFP4"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-decode"))
    ap.add_argument("--keep", action="store_true", help="Keep (and reuse) the checkpoints in --scratch.")
    args = ap.parse_args()
    config = preset_config(args.preset)
    setup: dict[str, float] = {}
    if not (args.keep and (args.scratch / "nvfp4" / "config.json").exists()):
        shutil.rmtree(args.scratch, ignore_errors=True)
        t0 = time.perf_counter()
        write_random_checkpoint(args.scratch / "bf16", config, seed=0, device=args.device)
        setup["checkpoint_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        exports(args.scratch / "bf16", args.scratch, args.device)
        setup["exports_s"] = round(time.perf_counter() - t0, 1)
    paths = {"bf16": args.scratch / "bf16", "GPTQ W4A16": args.scratch / "gptq", "NVFP4": args.scratch / "nvfp4"}
    vocab = min(config["vocab_size"], 4096)
    print(f"setup: {setup}", flush=True)
    rows = {}
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "setup": setup, "rows": rows}
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    for name in args.formats:
        rows[name] = measure(paths[name], args, vocab)
        print(f"{name}: {rows[name]}", flush=True)
        write_results(args.out, "decode.json", result)  # what is done so far, should a later format fail
    if args.context > 0:
        Console().print(batch1_table(rows, args))
    if args.batches or args.long > 0:
        Console().print(batches_table(rows, args))
    if not args.keep:
        shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
