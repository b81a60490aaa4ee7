"""The damage table of docs/quality.md: sala-small quantized each way, and its bf16 weights served with FP8 KV
caches, each scored by ``salaquant eval`` against the bf16 model on the same cases (NIAH and the RULER-style
tasks at the given lengths, held-out perplexity and KL, 256-token greedy continuations).

Every export and every report is made by the command-line tool itself, in its own process, so the table is what
a user running those commands sees; an export already in ``--out`` is reused (a later call finishes the table).
The bf16 row is the source side of the reports (the same in each). Prints a markdown table and writes
``damage.json`` beside the reports.

  python benchmarks/damage_small.py --out OUT --lengths 4k,16k --device cuda
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import CALIB, ROOT, SMALL

MODEL = SMALL
TASKS = "niah_multikey,niah_multivalue,vt,cwe,fwe"
EXPORTS = {
    "rtn": ["gptq", "--method", "rtn"],
    "gptq": ["gptq"],
    "gptq-no-bos": ["gptq", "--no-bos"],
    "nvfp4": ["nvfp4"],
    "nvfp4-dense-all": ["nvfp4", "--dense-all"],
}
ROWS = (  # (row, export or None for the bf16 model itself, eval flags)
    ("RTN W4A16", "rtn", []),
    ("GPTQ W4A16 (default)", "gptq", []),
    ("GPTQ W4A16, --no-bos", "gptq-no-bos", []),
    ("NVFP4 W4A4", "nvfp4", ["--activations", "fp4"]),
    ("NVFP4 weight-only", "nvfp4", ["--activations", "bf16"]),
    ("NVFP4 dense-all W4A4", "nvfp4-dense-all", ["--activations", "fp4"]),
    ("bf16, FP8 e4m3 KV cache", None, ["--kv-cache", "fp8_e4m3"]),
    ("bf16, FP8 e5m2 KV cache", None, ["--kv-cache", "fp8_e5m2"]),
)


def salaquant(*args: str) -> int:
    t = time.time()
    rc = subprocess.run([sys.executable, "-m", "salaquant", *args], cwd=ROOT).returncode
    print(f"[{time.time() - t:.0f} s, exit {rc}] salaquant {' '.join(args)}", flush=True)
    return rc


def scores(report: dict, side: str) -> dict[str, float]:
    """NIAH rate per length and task score per task and length of one side (``source`` or ``quantized``)."""
    out: dict[str, float] = {}
    for row in report["niah"]["by_length"]:
        out[f"niah {row['length'] // 1024}K"] = row[f"{side}_hits"] / row["cases"]
    for row in report["tasks"]["by_task"]:
        out[f"{row['task']} {row['length'] // 1024}K"] = row[side]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="4k,16k")
    ap.add_argument("--task-samples", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calib-samples", type=int, help="calibration samples (default: the commands' own)")
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 4096 tokens")
    ap.add_argument("--gen-tokens", type=int, default=256)
    args = ap.parse_args()
    calib = ["--calib", str(CALIB)] + (["--max-samples", str(args.calib_samples)] if args.calib_samples else [])
    for name, cmd in EXPORTS.items():
        if not (args.out / name / "config.json").exists():
            rc = salaquant(*cmd, "-i", str(MODEL), "-o", str(args.out / name), *calib)
            if rc != 0:
                raise SystemExit(f"the {name} export failed (exit {rc})")
    common = ["--niah", args.lengths, "--lengths", args.lengths, "--tasks", TASKS, "--task-samples",
              str(args.task_samples), "--gen-tokens", str(args.gen_tokens), "--layer-windows", "0",
              "--windows", str(args.windows), "--device", args.device]  # fmt: skip
    table = []
    for label, export, flags in ROWS:
        folder = args.out / "reports" / label.split(" (")[0].replace(" ", "_").replace(",", "")
        if not (folder / "eval.json").exists():
            quantized = args.out / export if export else MODEL
            rc = salaquant("eval", str(quantized), "-r", str(MODEL), *common, *flags, "--report", str(folder))
            if rc not in (0, 3):  # 3: a default threshold missed, the report is still written
                raise SystemExit(f"eval of {label} failed (exit {rc})")
        table.append((label, json.loads((folder / "eval.json").read_text())))
    source = scores(table[0][1], "source")
    gen0 = table[0][1]["generation"]
    cols = list(source)
    head = ["row", "ppl", "KL", "top-1", *cols, "loops (of prompts)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ppl0 = table[0][1]["perplexity"]["ppl_source"]
    lines.append(f"| bf16 | {ppl0:.3f} | - | - | " + " | ".join(f"{source[c]:.2f}" for c in cols)
                 + f" | {gen0['loops_source']} of {len(gen0['prompts'])} |")  # fmt: skip
    rows_json = []
    for label, rep in table:
        p, q = rep["perplexity"], scores(rep, "quantized")
        g = rep["generation"]
        cells = [f"{q[c]:.2f} ({q[c] - source[c]:+.2f})" for c in cols]
        lines.append(f"| {label} | {p['ppl_quantized']:.3f} ({p['ppl_quantized'] / p['ppl_source'] - 1:+.2%}) | "
                     f"{p['kl']:.4f} | {p['top1']:.2%} | " + " | ".join(cells)
                     + f" | {g['loops_quantized']} of {len(g['prompts'])} |")  # fmt: skip
        rows_json.append({"row": label, "perplexity": p, "scores": q, "loops": g["loops_quantized"]})
    print("\n".join(lines))
    (args.out / "damage.json").write_text(
        json.dumps({"source": source, "ppl_source": ppl0, "rows": rows_json, "settings": vars(args)}, default=str)
    )


if __name__ == "__main__":
    main()
