"""Run each GLA chunked-prefill variant once in its own process and report whether it completes and matches the
PyTorch reference: a fault in one variant (an illegal memory access poisons the whole CUDA context) cannot hide
which one it was.

  python benchmarks/gla_isolate.py --out OUT [--t 32768] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, torch
from salaquant.kernels.gla import triton_kernels as tk
from salaquant.model import gla as ref
t, dtype, out, pinned = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
H, D = 32, 128
q, k, v = (torch.randn(1, t, H, D, device="cuda").to(dtype) for _ in range(3))
g = -ref.alibi_slopes(H).cuda()
configs = tk.TUNED_CONFIGS[(9, 128, 128, "tf32", torch.float32, torch.float32)] if pinned != "autotuned" else None
if pinned.startswith("output:"):  # the pinned state kernel and one output-kernel candidate
    configs = (configs[0], tk.OUTPUT_CONFIGS[int(pinned.split(":")[1])])
o, s = tk.chunk_fwd(q, k, v, g, D**-0.5, None, True, out_dtype=getattr(torch, out), configs=configs)
torch.cuda.synchronize()
ro, rs = ref.chunk_gla(q, k, v, g, D**-0.5, None, True)
rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
print(json.dumps({"rel_o": rel(o, ro), "rel_state": rel(s, rs)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--t", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out-dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--configs", default="autotuned,pinned", help="autotuned, pinned (TUNED_CONFIGS), or output:I (one candidate)"
    )
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    rows = []
    cases = [(pinned, out) for pinned in args.configs.split(",") for out in args.out_dtypes.split(",")]
    for pinned, out in cases:
        cmd = [sys.executable, "-c", CHILD, str(args.t), args.dtype, out, pinned]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, check=False)
            rc, text = p.returncode, (p.stdout + p.stderr)
        except subprocess.TimeoutExpired:
            rc, text = -1, "timeout"
        row = {"configs": pinned, "out_dtype": out, "rc": rc}
        if rc == 0:
            row.update(json.loads(text.strip().splitlines()[-1]))
        else:
            row["error"] = text[-1500:]
        print(json.dumps(row)[:400], flush=True)
        rows.append(row)
    (args.out / "gla_isolate.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
