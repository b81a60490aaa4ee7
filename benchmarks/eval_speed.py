"""Wall time of ``salaquant eval`` at the real 9.48B shape: the defaults, the long-generation mode and the tasks.

Writes a random-weight checkpoint of the preset's shape (with the shipped model's tokenizer, whose ids all lie in the
full vocabulary), exports it with ``salaquant gptq --method rtn`` on one short calibration sample, then runs, each
as its own ``python -m salaquant eval EXPORT -r SOURCE --report DIR`` process (what a user runs; the wall time
includes Python start-up and loading both models):

* ``default``: no options;
* ``gen16x2048``: ``--gen-prompts 16 --gen-tokens 2048``;
* ``tasks``: ``--tasks niah,cwe,fwe,vt --lengths 32k,128k``.

Prints a table of wall seconds and eval's own phase timings (``timings_s`` of ``eval.json``) and writes JSON.

  python benchmarks/eval_speed.py --out OUT                                   # H200: full shape
  python benchmarks/eval_speed.py --out /tmp/e --preset tiny --device cpu --runs default   # CPU smoke
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import CALIB, TINY, shape_parser, write_results
from rich.console import Console
from rich.table import Table

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.model.tiny import preset_config, write_random_checkpoint

RUNS: dict[str, list[str]] = {
    "default": [],
    "gen16x2048": ["--gen-prompts", "16", "--gen-tokens", "2048"],
    "tasks": ["--tasks", "niah,cwe,fwe,vt", "--lengths", "32k,128k"],
}


def setup(scratch: Path, preset: str, device: str) -> dict[str, float]:
    """The bf16 source (with the shipped tokenizer) and its GPTQ W4A16 g128 export under ``scratch``."""
    shutil.rmtree(scratch, ignore_errors=True)
    t0 = time.perf_counter()
    config = preset_config(preset)
    shipped = json.loads((TINY / "config.json").read_text())
    config["vocab_size"] = max(config["vocab_size"], shipped["vocab_size"])  # every id of the shipped tokenizer
    source = write_random_checkpoint(scratch / "bf16", config, seed=0, device=device)
    for f in (TINY).glob("*token*"):
        shutil.copy(f, source / f.name)
    t1 = time.perf_counter()
    run_method(
        source,
        scratch / "gptq",
        [str(CALIB)],
        CalibOptions(max_samples=1, max_len=128),
        GPTQMethod(BitsOptions(), GPTQLayerOptions(method="rtn"), RunOptions(device=device, show_progress=False)),
        Console(quiet=True),
    )
    return {"checkpoint_s": round(t1 - t0, 1), "export_s": round(time.perf_counter() - t1, 1)}


def run_eval(scratch: Path, out: Path, name: str, device: str, timeout: float, key: str) -> dict[str, Any]:
    """One eval process of the run ``name`` (its report and log under ``key``): its exit status, wall seconds and
    phase timings."""
    report = out / key
    cmd = [sys.executable, "-m", "salaquant", "eval", str(scratch / "gptq"), "-r", str(scratch / "bf16")]
    cmd += ["--device", device, "--report", str(report), *RUNS[name]]
    t0 = time.perf_counter()
    with open(out / f"{key}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    row: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "args": RUNS[name]}
    result = report / "eval.json"
    if result.exists():
        row["timings_s"] = json.loads(result.read_text())["timings_s"]
    print(f"{key}: {row}", flush=True)
    return row


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds one eval may take before it is stopped.")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/salaquant-eval-speed"))
    ap.add_argument("--repeat", type=int, default=1, help="Run each eval this many times, one after the other.")
    ap.add_argument("--keep", action="store_true", help="Keep the checkpoints in --scratch.")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"setup": setup(args.scratch, args.preset, args.device), "runs": {}}
    print(f"setup: {result['setup']}", flush=True)
    for name in args.runs:
        for i in range(args.repeat):  # the first run of a fresh machine also compiles Triton's kernels
            key = name if i == 0 else f"{name}-{i + 1}"
            result["runs"][key] = run_eval(args.scratch, args.out, name, args.device, args.timeout, key)
            write_results(args.out, "eval_speed.json", result)
    phases = sorted({k for r in result["runs"].values() for k in r.get("timings_s", {})} - {"total"})
    t = Table(title=f"salaquant eval wall seconds, {args.preset} shape, GPTQ W4A16 against bf16")
    for col in ("run", "rc", "wall", "eval total", *phases):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name, r in result["runs"].items():
        tim = r.get("timings_s", {})
        cells = [f"{tim[p]:.1f}" if p in tim else "-" for p in ("total", *phases)]
        t.add_row(name, str(r["rc"]), f"{r['wall_s']:.1f}", *cells)
    Console().print(t)
    if not args.keep:
        shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
