"""The whole pipeline at the real 9.48B shape: ``salaquant gptq`` and ``salaquant nvfp4`` end to end on one GPU.

Writes a random-weight checkpoint of the preset's shape (``full``: the published MiniCPM-SALA configuration, real
tensor names, sharded), gives it the shipped tokenizer (its ids are a subset of the real vocabulary) and a
calibration JSONL of shipped text with one ``--long``-token sample and ``--short-count`` samples of ``--short``
tokens, then runs each quantizer exactly as the command does (load, calibrate, smooth, solve, pack, export,
format checker), loads each export with the runtime and greedily generates a few tokens (noise: the point is
that it loads and runs at full size). Prints and writes (JSON) per quantizer: wall time per phase, calibration
tokens/s, solve time per linear type, export time and size, peak GPU memory, peak CPU RSS, and the FLOP floor
of the calibration work with the fraction of it reached.

  python benchmarks/pipeline.py --out OUT                       # H200: full shape, 131072 + 4 x 8192 tokens
  python benchmarks/pipeline.py --out /tmp/p --preset tiny --long 600 --short 128 --short-count 2   # CPU smoke

``--gpu-profile`` records each quantizer's CUDA kernels with torch.profiler and reports the GPU's busy time
against the wall, per engine pass too (marker kernels at each pass), and the kernels that took longest.

``--budget 4.5bits`` also runs ``gptq --budget`` after the plain ``gptq`` and reports the search's seconds and the
wall time it adds to the plain run's.

``--nproc 1 2 4`` runs each command instead under ``torchrun --nproc-per-node N`` (as a user does; one process
through torchrun too) and reports per N the calibration tokens/s, the speed-up and scaling efficiency against
N = 1, the communication time, each process's tokens and peak GPU memory / RSS, and whether every shard's sha256
equals N = 1's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import math
import pstats
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import CALIB, TINY, work_flops
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.calibration.host_memory import process_memory
from salaquant.demo import checkpoint_bytes
from salaquant.model.config import SalaConfig
from salaquant.model.layout import parameter_shapes
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.workflow import load_tokenizer

TOKENIZER_SOURCE = TINY
TEXT_SOURCE = CALIB
TOKENIZER_VOCAB = 4096


def calibration_jsonl(path: Path, tokenizer: Any, lengths: list[int]) -> list[int]:
    """One record per wanted length: shipped texts joined (repeated as needed) and cut to that many tokens.
    Returns the token count of each record as the tokenizer reads it back."""
    texts = [json.loads(line)["text"] for line in TEXT_SOURCE.read_text().splitlines() if line.strip()]
    records, got, cursor = [], [], 0
    for want in lengths:
        ids: list[int] = []
        while len(ids) < want:
            ids += tokenizer(texts[cursor % len(texts)] + "\n", add_special_tokens=False)["input_ids"]
            cursor += 1
        text = tokenizer.decode(ids[:want])
        records.append({"text": text})
        got.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return got


def _rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _current_rss_gib() -> float:
    return (process_memory() or 0) / 2**30


class RssTimeline(logging.Handler):
    """Samples the process's resident memory every ``interval`` seconds and splits the peak by phase: before the
    calibration engine starts (tokenising, setup), while it runs (the largest sample per layer), and after its last
    layer (export and format check). Phases come from the engine's own log records."""

    def __init__(self, interval: float = 0.1) -> None:
        super().__init__(logging.INFO)
        self.interval = interval
        self.phase = "setup"
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def emit(self, record: logging.LogRecord) -> None:
        self._sample()
        msg = record.getMessage()
        if msg.startswith("calibration:"):
            self.phase = "calibration"
        elif msg.endswith("done") and msg.startswith("layer "):
            self.peaks[f"layer {msg.split()[1]}"] = self.peaks.pop("calibration", 0.0)
            self.phase = "calibration"

    def _sample(self) -> None:
        rss = _current_rss_gib()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), rss)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssTimeline:
        logging.getLogger("salaquant.calibration.engine").addHandler(self)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end of the run belongs to its last phase
        logging.getLogger("salaquant.calibration.engine").removeHandler(self)

    def summary(self) -> dict[str, float]:
        layers = [v for k, v in self.peaks.items() if k.startswith("layer ")]
        after = self.peaks.get("calibration", 0.0)  # samples after the last "layer done": export and check
        return {
            "setup": round(self.peaks.get("setup", 0.0), 2),
            "calibration_layers_max": round(max(layers, default=0.0), 2),
            "calibration_first_layer": round(layers[0], 2) if layers else 0.0,
            "export_and_check": round(after, 2),
        }


def solve_seconds(report: dict[str, Any]) -> dict[str, float]:
    """Total solve seconds per (layer kind, linear) from a quant_report.json."""
    out: dict[str, float] = {}
    for layer in report.get("layers", []):
        for name, lin in layer.get("linears", {}).items():
            key = f"{layer['kind']} {name}"
            out[key] = round(out.get(key, 0.0) + float(lin.get("seconds", 0.0)), 2)
    return out


@dataclass(frozen=True)
class QuantRun:
    """One quantizer command to time: the method (``gptq`` or ``nvfp4``), the source checkpoint, the calibration
    file, the output folder, the calibration's longest sample, and the settings the benchmark varies (nvfp4's
    input-scale rule and rounding, None: its own; gptq's ``--budget``, None: none)."""

    method: str
    model: Path
    calib: Path
    out: Path
    max_len: int
    input_scale: str | None = None
    budget: str | None = None
    rounding: str | None = None


def layer_digests(folder: Path) -> dict[str, str]:
    """sha256 of an export's tensors per decoder layer (``"-1"``: the rest), over each tensor's name, dtype, shape and
    bytes in name order, whatever shard holds it: two runs' exports compare layer by layer, so a difference is
    found where it starts."""
    import hashlib
    import re

    from safetensors import safe_open

    hashes: dict[int, Any] = {}
    names: list[tuple[str, Path]] = []
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            names += [(name, shard) for name in f.keys()]  # noqa: SIM118 (safe_open is no mapping)
    for name, shard in sorted(names):
        with safe_open(str(shard), framework="pt") as f:
            t = f.get_tensor(name)
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        h = hashes.setdefault(int(layer.group(1)) if layer else -1, hashlib.sha256())
        h.update(f"{name}:{t.dtype}:{list(t.shape)}:".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {str(k): hashes[k].hexdigest() for k in sorted(hashes)}


def _budget_figures(report: dict[str, Any]) -> dict[str, Any]:
    """``{"budget": the search's figures less its units}`` where the run searched a budget, else nothing."""
    searched = report.get("budget")
    return {"budget": {k: v for k, v in searched.items() if k != "units"}} if searched else {}


def _phase_seconds(report: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of a quant_report.json, to 2 decimals."""
    return {k: round(float(v), 2) for k, v in report["timings_s"].items()}


def run_quantizer(job: QuantRun, device: str) -> dict[str, Any]:
    """``job`` in this process, as the command runs it: wall time and its phases, calibration tokens/s, solve time
    per linear, export size, peak GPU memory and CPU RSS (by phase too)."""
    from salaquant.driver import run_method
    from salaquant.gptq.command import GPTQMethod, RunOptions
    from salaquant.gptq.layer import GPTQLayerOptions
    from salaquant.gptq.plan import BitsOptions
    from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
    from salaquant.nvfp4.layer import NVFP4LayerOptions

    method, model, calib, out = job.method, job.model, job.calib, job.out
    options = CalibOptions(max_len=job.max_len)
    console = Console(quiet=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with RssTimeline() as rss:
        if method == "gptq":
            run = RunOptions(device=device, show_progress=False, overwrite=True)
            bits = BitsOptions(budget=job.budget)
            run_method(model, out, [str(calib)], options, GPTQMethod(bits, GPTQLayerOptions(), run), console)
        else:
            run = NVFP4RunOptions(device=device, show_progress=False, overwrite=True)
            chosen = {"input_scale": job.input_scale, "rounding": job.rounding}
            layer = NVFP4LayerOptions(**{k: v for k, v in chosen.items() if v is not None})
            run_method(model, out, [str(calib)], options, NVFP4Method(layer, run), console)
    wall = time.perf_counter() - t0
    report = json.loads((out / "quant_report.json").read_text())
    timings = report["timings_s"]
    calib_s = float(timings.get("calibrate_and_quantize", wall))
    tokens = int(report["calibration"]["tokens"])
    return {
        "wall_s": round(wall, 2),  # the phases round to 2 decimals too, so wall_s >= each of them
        "phase_seconds": _phase_seconds(report),
        "export_and_check_s": round(wall - calib_s, 1),
        "calibration_tokens": tokens,
        "calibration_tokens_per_s": round(tokens / calib_s, 1),
        "tokens_per_s_end_to_end": round(tokens / wall, 1),
        "solve_seconds_per_linear": solve_seconds(report),
        "export_bytes": checkpoint_bytes(out),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "peak_cpu_rss_gib": _rss_gib(),  # the process's peak so far (earlier work in the process included)
        "cpu_rss_gib_by_phase": rss.summary(),  # sampled every 0.1 s during this quantizer only
        "layer_sha256": layer_digests(out),  # after the timing
        **_budget_figures(report),
    }


def run_launched(job: QuantRun, nproc: int) -> dict[str, Any]:
    """The command under ``torchrun --nproc-per-node nproc`` (one process: through torchrun too): wall time,
    calibration tokens/s, communication time, per-process tokens and peaks, and each shard's sha256."""
    import hashlib
    import subprocess
    import sys

    out = job.out
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", str(nproc), "-m", "salaquant", job.method, "-i", str(job.model)]
    cmd += ["-o", str(out), "--calib", str(job.calib), "--max-len", str(job.max_len), "--overwrite"]
    if job.method == "nvfp4" and job.input_scale is not None:
        cmd += ["--input-scale", job.input_scale]
    if job.method == "nvfp4" and job.rounding is not None:
        cmd += ["--rounding", job.rounding]
    if job.budget is not None:
        cmd += ["--budget", job.budget]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads((out / "quant_report.json").read_text())
    timings = report["timings_s"]
    calib_s = float(timings["calibrate_and_quantize"])
    tokens = int(report["calibration"]["tokens"])
    shards = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.glob("*.safetensors"))}
    return {
        "processes": nproc,
        "wall_s": round(wall, 2),
        "phase_seconds": _phase_seconds(report),
        "calibration_tokens_per_s": round(tokens / calib_s, 1),
        "communicate_s": round(float(timings.get("communicate", 0.0)), 2),
        "rank_tokens": report["rank_tokens"],
        "rank_peaks": report["rank_peaks"],
        "sha256": shards,
        **_budget_figures(report),
    }


def scaling(job: QuantRun, nprocs: list[int]) -> dict[int, dict[str, Any]]:
    """``run_launched`` for every process count N, writing to ``job.out`` with ``-nN`` added to its name;
    efficiency = rate / (N x the one-process rate), and whether the shards are those of one process."""
    rows = {}
    for n in nprocs:
        rows[n] = run_launched(replace(job, out=job.out.with_name(f"{job.out.name}-n{n}")), n)
        print(json.dumps({job.method: {n: rows[n]}}), flush=True)
    if 1 in rows:
        for n, r in rows.items():
            r["speedup"] = round(r["calibration_tokens_per_s"] / rows[1]["calibration_tokens_per_s"], 3)
            r["efficiency"] = round(r["speedup"] / n, 3)
            r["same_bytes_as_one"] = r["sha256"] == rows[1]["sha256"]
    return rows


def with_budget_fractions(row: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """A ``--budget`` run's row with the wall time it added to the plain run's, and the share of the plain wall
    time taken by the search (before the calibration) and by the export's KL measured back (after it)."""
    row["added_wall_fraction"] = round(row["wall_s"] / plain["wall_s"] - 1, 3)
    searched = row["budget"]["search_seconds"] + row["budget"]["measure_seconds"]
    row["search_and_check_fraction_of_plain_wall"] = round(searched / plain["wall_s"], 3)
    return row


def gla_autotuned() -> dict[str, dict[str, str]]:
    """The GLA kernels' autotuner choices made in this process (empty on the CPU) and the pinned table."""
    try:
        from salaquant.kernels.gla import triton_kernels
    except ImportError:
        return {}
    kernels = (("state", triton_kernels._chunk_state_kernel), ("output", triton_kernels._chunk_output_kernel))
    out = {name: {str(key): str(cfg) for key, cfg in getattr(k, "cache", {}).items()} for name, k in kernels}
    # cases launched with a measured configuration skip the autotuner and appear here instead
    out["tuned_table"] = {str(key): str(cfgs) for key, cfgs in triton_kernels.TUNED_CONFIGS.items()}
    return out


def generate_check(path: Path, device: str, tokens: int = 8) -> dict[str, Any]:
    from salaquant.runtime.load import load

    t0 = time.perf_counter()
    model = load(path, device=device)
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, TOKENIZER_VOCAB, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    out = model.greedy(ids, max_new_tokens=tokens)
    gen_s = time.perf_counter() - t0
    new = out[0, ids.shape[1] :].tolist()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"load_s": round(load_s, 1), "generate_s": round(gen_s, 2), "tokens": new}


_MARKER_KERNEL = "spin_kernel"
"""The kernel ``torch.cuda._sleep`` launches: ``cuda_profiler`` marks the engine's passes on the GPU's timeline."""


@contextlib.contextmanager
def cuda_profiler() -> Iterator[tuple[torch.profiler.profile, list[str]]]:
    """torch.profiler recording CUDA activity only (no CPU ops, shapes, stacks or memory), for ``kernel_summary``;
    and the engine's passes marked on the GPU's own timeline: each start of a pass (statistics, quantize,
    propagate) and each layer's end launches a one-microsecond ``torch.cuda._sleep`` kernel, named in the list
    (``pass:WHAT`` or ``end``) in launch order. A pass then spans from its marker to the next on the GPU's clock,
    so the gaps between its kernels are time the GPU waited for the host."""
    from salaquant.progress import EngineProgress

    marks: list[str] = []
    phase, layer_done = EngineProgress.phase, EngineProgress.layer_done

    def mark(what: str) -> None:
        marks.append(what)
        torch.cuda._sleep(1000)

    def marked_phase(self: EngineProgress, index: int, kind: str, what: str) -> None:
        mark(f"pass:{what}")
        phase(self, index, kind, what)

    def marked_layer_done(self: EngineProgress, index: int, note: str = "") -> None:
        mark("end")
        layer_done(self, index, note)

    EngineProgress.phase, EngineProgress.layer_done = marked_phase, marked_layer_done  # type: ignore[method-assign]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            yield prof, marks
    finally:
        EngineProgress.phase, EngineProgress.layer_done = phase, layer_done  # type: ignore[method-assign]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering ``spans``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by the disjoint sorted intervals ``busy``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in busy if s < end and e > start)


def kernel_summary(prof: torch.profiler.profile, marks: list[str], wall_s: float, top: int = 25) -> dict[str, Any]:
    """What the GPU did during a run, from the profiler's Chrome trace: seconds in which any kernel ran (the union
    of their intervals, so kernels on several streams count once), the sums of kernel and of copy durations, the
    kernels that took longest, grouped by name, and per engine pass (``cuda_profiler``'s markers) its seconds on
    the GPU's clock and the busy seconds within them. ``busy_fraction`` is the busy time over the run's wall (the
    profiler's own cost included): a change of scheduling alone cannot take the run below ``busy_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    return trace_summary(events, marks, wall_s, top)


def trace_summary(events: list[dict[str, Any]], marks: list[str], wall_s: float, top: int = 25) -> dict[str, Any]:
    """``kernel_summary`` of a Chrome trace's events (``ts`` and ``dur`` in microseconds)."""
    spans: list[tuple[float, float]] = []
    markers: list[float] = []
    by_name: dict[str, list[float]] = {}
    copies = 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))  # microseconds
        name, cat = e.get("name", "?"), e.get("cat")
        if cat in ("gpu_memcpy", "gpu_memset"):
            copies += dur
        elif cat == "kernel" and _MARKER_KERNEL in name:
            markers.append(start)
        elif cat == "kernel":
            spans.append((start, start + dur))
            entry = by_name.setdefault(name, [0.0, 0])
            entry[0] += dur
            entry[1] += 1
    busy = _union(spans)
    busy_s = sum(e - s for s, e in busy) / 1e6
    passes: dict[str, dict[str, float]] = {}
    markers.sort()
    if len(markers) == len(marks):
        for what, start, end in zip(marks, markers, markers[1:], strict=False):
            if what.startswith("pass:"):
                entry = passes.setdefault(what.removeprefix("pass:"), {"s": 0.0, "gpu_busy_s": 0.0})
                entry["s"] += (end - start) / 1e6
                entry["gpu_busy_s"] += _overlap(busy, start, end) / 1e6
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "wall_s": wall_s,
        "busy_s": round(busy_s, 2),
        "busy_fraction": round(busy_s / wall_s, 3),
        "kernel_sum_s": round(sum(v[0] for v in by_name.values()) / 1e6, 2),
        "copy_sum_s": round(copies / 1e6, 2),
        "kernels": len(spans),
        "markers": {"launched": len(marks), "found": len(markers)},
        "passes": {what: {k: round(v, 2) for k, v in entry.items()} for what, entry in passes.items()},
        "top": [{"name": n[:120], "s": round(v[0] / 1e6, 2), "calls": int(v[1])} for n, v in kernels[:top]],
    }


def _row_key(method: str, rounding: str | None) -> str:
    """A result row's name: the method, with the rounding where the run names one."""
    return method if rounding is None else f"{method}-{rounding}"


def prepare_inputs(args: argparse.Namespace, device: str) -> tuple[Path, Path, list[int], float | None]:
    """The random-weight checkpoint of ``args.preset`` (first ``args.layers`` layers; written once into
    ``args.scratch``, reused after) with the shipped tokenizer, and the calibration JSONL of one ``args.long`` and
    ``args.short_count`` x ``args.short`` tokens. Returns the checkpoint, the JSONL, the samples' token counts and the
    seconds the checkpoint took to write (None: reused)."""
    args.scratch.mkdir(parents=True, exist_ok=True)
    model = args.scratch / (f"random-{args.preset}" + (f"-{args.layers}l" if args.layers else ""))
    write_s = None
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        config = preset_config(args.preset)
        if args.layers:
            config["num_hidden_layers"] = args.layers
            config["mixer_types"] = config["mixer_types"][: args.layers]
        config["vocab_size"] = max(int(config["vocab_size"]), TOKENIZER_VOCAB)  # the shipped tokenizer's ids fit
        write_random_checkpoint(model, config, seed=0, device=device, overwrite=True)
        write_s = round(time.perf_counter() - t0, 1)
    for f in TOKENIZER_SOURCE.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, model / f.name)
    calib = args.scratch / "calib.jsonl"
    lengths = calibration_jsonl(calib, load_tokenizer(model), [args.long] + [args.short] * args.short_count)
    return model, calib, lengths, write_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-pipeline"))
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--short", type=int, default=8192)
    ap.add_argument("--short-count", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["gptq", "nvfp4"], choices=["gptq", "nvfp4"])
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 rate used for the floor")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (smaller runs)")
    ap.add_argument("--profile", action="store_true", help="cProfile each quantizer; top functions to OUT")
    ap.add_argument(
        "--gpu-profile",
        action="store_true",
        help="torch.profiler over each quantizer (CUDA): kernel time against wall, top kernels, to OUT",
    )
    ap.add_argument("--nvfp4-input-scale", choices=["max", "mse"], help="nvfp4's input-scale rule (default: its own)")
    ap.add_argument(
        "--nvfp4-rounding",
        nargs="+",
        choices=["nearest", "gptq"],
        help="run nvfp4 once per rounding named (rows nvfp4-nearest, nvfp4-gptq; default: once, its own rounding)",
    )
    ap.add_argument(
        "--budget",
        help="also run gptq --budget SIZE after plain gptq: the search's seconds and the wall time it adds",
    )
    ap.add_argument(
        "--nproc", type=int, nargs="+", help="run each command under torchrun with these process counts (1 2 4)"
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    model, calib, lengths, write_s = prepare_inputs(args, device)
    if write_s is not None:
        res["write_checkpoint_s"] = write_s
    cfg = SalaConfig.from_file(model)
    max_len = max(lengths)
    params = sum(math.prod(shape) for shape in parameter_shapes(cfg).values())
    res.update({"preset": args.preset, "parameters": params, "calibration_lengths": lengths})
    flops = work_flops(cfg, [min(n, max_len) for n in lengths], hessian=True)
    floor = flops["total"] / (args.peak_tflops * 1e12)
    res["calibration_flops"] = {k: f"{v:.3e}" for k, v in flops.items()}
    res["calibration_flop_floor_s"] = round(floor, 2)
    if args.nproc:
        for method in args.methods:
            job = QuantRun(method, model, calib, args.scratch / f"export-{method}", max_len, args.nvfp4_input_scale)
            res[method] = scaling(job, args.nproc)
            if method == "gptq" and args.budget:
                n = min(args.nproc)
                out = args.scratch / "export-gptq-budget"
                b = run_launched(QuantRun(method, model, calib, out, max_len, budget=args.budget), n)
                res["gptq_budget"] = {n: with_budget_fractions(b, res[method][n])}
                print(json.dumps({"gptq_budget": res["gptq_budget"]}), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"pipeline-{args.preset}-nproc.json").write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out / f'pipeline-{args.preset}-nproc.json'}")
        return
    rows = [(m, None) for m in args.methods if m != "nvfp4" or not args.nvfp4_rounding]
    if "nvfp4" in args.methods and args.nvfp4_rounding:
        rows += [("nvfp4", rounding) for rounding in args.nvfp4_rounding]
    for method, rounding in rows:
        key = _row_key(method, rounding)
        out = args.scratch / f"export-{key}"
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        job = QuantRun(method, model, calib, out, max_len, args.nvfp4_input_scale, rounding=rounding)
        gpu_profiler = cuda_profiler() if args.gpu_profile and device == "cuda" else contextlib.nullcontext()
        with gpu_profiler as profiled:
            r = run_quantizer(job, device)
        if profiled is not None:
            r["gpu_profile"] = kernel_summary(*profiled, r["wall_s"])
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"gpu-profile-{key}.json").write_text(json.dumps(r["gpu_profile"], indent=2))
        if profiler is not None:
            profiler.disable()
            args.out.mkdir(parents=True, exist_ok=True)
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(30)
            (args.out / f"profile-{key}.txt").write_text(text.getvalue())
        calib_s = r["phase_seconds"].get("calibrate_and_quantize", r["wall_s"])
        r["fraction_of_flop_floor"] = round(floor / calib_s, 3)
        r["generate"] = generate_check(out, device)
        res[key] = r
        print(json.dumps({key: r}, indent=2), flush=True)
        if method == "gptq" and args.budget:
            out = args.scratch / "export-gptq-budget"
            b = run_quantizer(QuantRun(method, model, calib, out, max_len, budget=args.budget), device)
            res["gptq_budget"] = with_budget_fractions(b, r)
            print(json.dumps({"gptq_budget": b}, indent=2), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    res["gla_autotuned"] = gla_autotuned()
    res["hidden_state_gib"] = round(sum(lengths) * cfg.hidden_size * 2 / 2**30, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pipeline-{args.preset}.json").write_text(json.dumps(res, indent=2))
    if not args.keep:
        for method, rounding in rows:
            shutil.rmtree(args.scratch / f"export-{_row_key(method, rounding)}", ignore_errors=True)
    print(f"wrote {args.out / f'pipeline-{args.preset}.json'}")


if __name__ == "__main__":
    main()
