"""Instruction counts of the tiled W4A16 kernel's main loop, compiled for sm_90 (Hopper) on any machine.

Triton compiles the kernel for ``GPUTarget("cuda", 90, 32)`` with its bundled ``ptxas`` (no GPU needed),
``nvdisasm`` lists the machine code, and the longest backward branch's body (the K loop) is counted by opcode: per
thread and K tile, what the dequantization, the address arithmetic and the tensor-core product cost in issue slots.
A proxy for where a launch configuration spends its time, to be confirmed by ``benchmarks/kernels_w4a16.py`` on the
GPU. Operands as a GPTQ export serves them: bf16 activations and outputs, fp16 scales, groups of 128, K a multiple
of ``BLOCK_K``.

  python benchmarks/tiled_sass.py --out OUT [--configs "BLOCK_M=64,BLOCK_N=128,BLOCK_K=128,SWAP=1,warps=4" ...]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from common import write_results
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from salaquant.kernels.w4a16.tiled import tiled_kernel

DEFAULT_CONFIGS = [
    "BLOCK_M=64,BLOCK_N=128,BLOCK_K=128,SWAP=0,warps=4",
    "BLOCK_M=64,BLOCK_N=128,BLOCK_K=128,SWAP=1,warps=4",
    "BLOCK_M=32,BLOCK_N=128,BLOCK_K=128,SWAP=0,warps=4",
    "BLOCK_M=32,BLOCK_N=128,BLOCK_K=128,SWAP=1,warps=4",
    "BLOCK_M=64,BLOCK_N=256,BLOCK_K=128,SWAP=1,warps=8",
    "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,SWAP=0,warps=8",
    "BLOCK_M=128,BLOCK_N=128,BLOCK_K=128,SWAP=1,warps=8",
]
_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_for_hopper(meta: dict[str, int], warps: int, stages: int) -> bytes:
    """The cubin of ``tiled_kernel`` for sm_90 with launch settings ``meta`` (BLOCK_M, BLOCK_N, BLOCK_K, SWAP)."""
    signature = {
        "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "MAGIC": "i32", "M_BUCKET": "i32",
    }  # fmt: skip
    constants = {"BITS": 4, "GROUP_SIZE": 128, "DOT_PRECISION": "tf32", "EXPAND": True, "EVEN_K": True, "GROUP_M": 8}
    constants |= {"SWAP": bool(meta.get("SWAP", 0))} | {k: v for k, v in meta.items() if k != "SWAP"}
    signature |= dict.fromkeys(constants, "constexpr")
    source = ASTSource(fn=tiled_kernel.fn, signature=signature, constexprs=constants)
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["cubin"]


def loop_opcodes(sass: str) -> collections.Counter[str]:
    """Opcodes of the longest loop: the body between a label and the furthest backward branch to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    body = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > body[1] - body[0]:
            body = (labels[m.group(1)], i)
    return collections.Counter(
        m.group(1).split(".")[0] for line in lines[body[0] : body[1] + 1] if (m := _OPCODE.match(line))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    rows = []
    for spec in args.configs:
        meta = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        warps = meta.pop("warps", 4)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compile_for_hopper(meta, warps, args.stages))
            f.flush()
            sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
        ops = loop_opcodes(sass)
        per_thread = meta["BLOCK_N"] * meta["BLOCK_K"] // (32 * warps)
        row = {"config": spec, "loop_instructions": sum(ops.values()), "weights_per_thread": per_thread}
        row["per_weight"] = round(row["loop_instructions"] / per_thread, 2)
        row["opcodes"] = dict(ops.most_common())
        rows.append(row)
        print(f"{spec}: {row['loop_instructions']} a K tile, {row['per_weight']} a weight; {dict(ops.most_common(8))}")
    payload = {"triton": triton.__version__, "target": "sm_90", "stages": args.stages, "rows": rows}
    write_results(args.out, "tiled_sass.json", payload)


if __name__ == "__main__":
    main()
