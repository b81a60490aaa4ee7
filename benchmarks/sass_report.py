"""Compile a Triton kernel for sm_90 on any machine (no GPU needed) and summarise its machine code.

Prints registers, spills, shared memory and a histogram of the SASS memory and math instructions (load widths,
tensor-core ops), which is what decides a memory-bound kernel's speed before any device time is spent. Integer
arguments and pointers are declared 16-divisible, as the Triton launcher specializes them at SALA shapes.

  python benchmarks/sass_report.py salaquant.kernels.w4a16.gemv:gemv_kernel \
      --sig x_ptr=*bf16 w_ptr=*i32 ... --const BITS=4 GROUP_SIZE=128 --warps 4 [--maxnreg N] [--sass FILE]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_kernel(
    fn, sig: dict[str, str], consts: dict[str, object], warps: int, stages: int, maxnreg: int | None = None
):
    names = fn.arg_names
    full = dict(sig)
    for name in consts:
        full[name] = "constexpr"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or t == "i32"}
    src = ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg}
    )


def summarize(kernel, sass_path: Path | None = None) -> dict[str, object]:
    cubin = Path("/tmp/_sass_report.cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    res = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    sass = subprocess.run([str(_BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    if sass_path is not None:
        sass_path.write_text(sass)
    ops = collections.Counter(
        m.group(1)
        for m in re.finditer(r"\s((?:LDG|STG|LDS|STS|LDL|STL|HMMA|HGMMA|FFMA|ATOMG|LDGSTS|SHFL)[.A-Z0-9_]*)", sass)
    )
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    out: dict[str, object] = {"ops": dict(sorted(ops.items()))}
    if usage:
        out.update(zip(("regs", "stack", "shared", "local"), map(int, usage.groups()), strict=True))
    return out


def _kv(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", help="module:function of a @triton.jit (or autotuned) kernel")
    ap.add_argument("--sig", nargs="+", required=True, help="name=type for every run-time argument")
    ap.add_argument("--const", nargs="*", default=[], help="name=value for every constexpr")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, help="register limit per thread (ptxas .maxnreg)")
    ap.add_argument("--sass", type=Path)
    args = ap.parse_args()
    mod, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(mod), name)
    while not isinstance(fn, triton.runtime.JITFunction):  # autotuner / heuristics wrappers
        fn = fn.fn
    consts = {
        k: (int(v) if re.fullmatch(r"-?\d+", v) else v == "True" if v in ("True", "False") else v)
        for k, v in _kv(args.const).items()
    }
    print(summarize(compile_kernel(fn, _kv(args.sig), consts, args.warps, args.stages, args.maxnreg), args.sass))


if __name__ == "__main__":
    main()
