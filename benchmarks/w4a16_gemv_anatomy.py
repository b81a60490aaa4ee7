"""Where the one-row W4A16 GEMV's time goes, on one GPU: the library's paired kernel rebuilt with parts changed.

Variants of ``salaquant.kernels.w4a16.paired_gemv`` at the library's launch (256 columns x 64 rows of K, 4 warps,
its split count), each timed like ``kernels_w4a16.py`` (CUDA-graph medians over 4 weight copies, so the weights
come from HBM) with cuBLAS bf16 ``F.linear`` in the same run:

- ``lib``: ``matmul_paired`` itself;
- ``read``: the same loads and split-K store with the math replaced by one xor per word (the memory floor of the
  access pattern);
- ``chainC``: ``C`` words of one column summed in one fp16 pair before the widening to fp32 (C = 1 is the
  library's arithmetic; 2 and 4 save 4 of the 17 instructions per word once per pair / quad of words);
- ``prex``: the activation pairs ``(x[8 r + j], x[8 r + j + 4])`` built once outside the kernel and loaded
  (the cost of building them per tile);
- ``evict``: the words loaded with ``evict_first``.

Each variant's relative error against the fp32 product of the dequantized weight is printed beside its time.

  python benchmarks/w4a16_gemv_anatomy.py --out OUT.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels_w4a16 import COPIES, GROUP, SHAPES, _time_us
from results import write_results
from salaquant.kernels.paired_f16 import emulated_fma2, f16_pair, half, halves
from salaquant.kernels.w4a16 import triton_kernels as tk
from salaquant.kernels.w4a16.paired_gemv import OUT_SCALE, dequant_constants, emulated_pairs
from salaquant.kernels.w4a16.split_k import k_slice, split_k_store


def _chain_ptx(words: int) -> str:
    """PTX summing ``words`` words (operands ``$1..``) against their activation pairs in one fp16 pair ``p``."""
    x0 = 1 + words  # first activation pair operand
    s = x0 + 4 * words  # scale, then acc, then the seven constants
    lo_mask, magic, hi_mask, lo_mul, lo_add, hi_mul, hi_add = (f"${s + 2 + i}" for i in range(7))
    body = [".reg .b32 q8, a0, a1, a2, a3, p;", ".reg .b16 l16, h16;", ".reg .f32 lf, hf;"]
    for w in range(words):
        word = f"${1 + w}"
        xs = [f"${x0 + 4 * w + j}" for j in range(4)]
        body += [
            f"shr.u32 q8, {word}, 8;",
            f"lop3.b32 a0, {word}, {lo_mask}, {magic}, 0xEA;",
            f"lop3.b32 a1, {word}, {hi_mask}, {magic}, 0xEA;",
            f"lop3.b32 a2, q8, {lo_mask}, {magic}, 0xEA;",
            f"lop3.b32 a3, q8, {hi_mask}, {magic}, 0xEA;",
            f"fma.rn.f16x2 a0, a0, {lo_mul}, {lo_add};",
            f"fma.rn.f16x2 a1, a1, {hi_mul}, {hi_add};",
            f"fma.rn.f16x2 a2, a2, {lo_mul}, {lo_add};",
            f"fma.rn.f16x2 a3, a3, {hi_mul}, {hi_add};",
            f"mul.rn.f16x2 p, a0, {xs[0]};" if w == 0 else f"fma.rn.f16x2 p, a0, {xs[0]}, p;",
            f"fma.rn.f16x2 p, a1, {xs[1]}, p;",
            f"fma.rn.f16x2 p, a2, {xs[2]}, p;",
            f"fma.rn.f16x2 p, a3, {xs[3]}, p;",
        ]
    body += [
        "mov.b32 {l16, h16}, p;",
        "cvt.f32.f16 lf, l16;",
        "cvt.f32.f16 hf, h16;",
        "add.f32 lf, lf, hf;",
        f"fma.rn.f32 $0, lf, ${s}, ${s + 1};",
    ]
    return "{\n" + "\n".join(body) + "\n}"


_PTX = {c: tl.constexpr(_chain_ptx(c)) for c in (1, 2, 4)}
_CONSTRAINTS = {c: tl.constexpr("=f," + ",".join(["r"] * (5 * c)) + ",f,f," + ",".join(["r"] * 7)) for c in (1, 2, 4)}


@triton.jit
def _emulated_chain(ws, xs, scale, acc, C: tl.constexpr):
    """The interpreter's version of the chain PTX (per half fp32 math rounded to fp16 after each operation)."""
    p = tl.zeros(ws[0].shape, tl.int32)
    for w in tl.static_range(C):
        a0, a1, a2, a3 = emulated_pairs(ws[w])
        p = emulated_fma2(a0, xs[4 * w], p)
        p = emulated_fma2(a1, xs[4 * w + 1], p)
        p = emulated_fma2(a2, xs[4 * w + 2], p)
        p = emulated_fma2(a3, xs[4 * w + 3], p)
    return (half(p, False) + half(p, True)) * scale + acc


@triton.jit
def _pairs(
    x_ptr, xp_ptr, rows, mask_r, shape: tl.constexpr, BF16: tl.constexpr, PRE_X: tl.constexpr, ASM: tl.constexpr
):
    """The four activation pairs ``(x[8 r + j], x[8 r + j + 4])`` of word rows ``rows``, broadcast to ``shape``."""
    if PRE_X:
        p0 = tl.load(xp_ptr + rows * 4 + 0, mask=mask_r, other=0)
        p1 = tl.load(xp_ptr + rows * 4 + 1, mask=mask_r, other=0)
        p2 = tl.load(xp_ptr + rows * 4 + 2, mask=mask_r, other=0)
        p3 = tl.load(xp_ptr + rows * 4 + 3, mask=mask_r, other=0)
    else:
        xb = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * 4
        v01 = f16_pair(tl.load(xb + 0, mask=mask_r, other=0), BF16, ASM)
        v23 = f16_pair(tl.load(xb + 1, mask=mask_r, other=0), BF16, ASM)
        v45 = f16_pair(tl.load(xb + 2, mask=mask_r, other=0), BF16, ASM)
        v67 = f16_pair(tl.load(xb + 3, mask=mask_r, other=0), BF16, ASM)
        p0 = halves(v01, v45, False)
        p1 = halves(v01, v45, True)
        p2 = halves(v23, v67, False)
        p3 = halves(v23, v67, True)
    return (
        tl.broadcast_to(p0[:, None], shape),
        tl.broadcast_to(p1[:, None], shape),
        tl.broadcast_to(p2[:, None], shape),
        tl.broadcast_to(p3[:, None], shape),
    )


@triton.jit
def _load(w_ptr, rows, t_end, offs_n, N, K, ROWS: tl.constexpr, EVICT: tl.constexpr):
    mask = (rows < tl.minimum(K // 8, t_end * ROWS))[:, None] & (offs_n < N)[None, :]
    ptrs = w_ptr + rows[:, None] * N + offs_n[None, :]
    if EVICT:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _variant_kernel(
    x_ptr,
    xp_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    C: tl.constexpr,
    READ_ONLY: tl.constexpr,
    PRE_X: tl.constexpr,
    EVICT: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    PTX: tl.constexpr,
    CONSTRAINTS: tl.constexpr,
):
    """Group 128, ``BLOCK_K`` dividing it; the tile's ``BLOCK_K / 8`` word rows as ``C`` sub-tiles of ``SUB`` rows."""
    ROWS: tl.constexpr = BLOCK_K // 8
    SUB: tl.constexpr = ROWS // C
    shape: tl.constexpr = (SUB, BLOCK_N)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, SUB)
    t_start, t_end = k_slice(K, BLOCK_K)
    acc = tl.zeros(shape, tl.float32)
    bits = tl.zeros(shape, tl.int32)
    ws = ()
    for c in tl.static_range(C):
        ws = ws + (_load(w_ptr, t_start * ROWS + c * SUB + offs_r, t_end, offs_n, N, K, ROWS, EVICT),)  # noqa: RUF005 (Triton has no tuple unpacking)
    for t in range(t_start, t_end):
        nxt = ()  # the next tile's words, issued before this tile's math (as the library's kernel does)
        xs = ()
        for c in tl.static_range(C):
            rows = t * ROWS + c * SUB + offs_r
            nxt = nxt + (_load(w_ptr, rows + ROWS, t_end, offs_n, N, K, ROWS, EVICT),)  # noqa: RUF005 (Triton has no tuple unpacking)
            if not READ_ONLY:
                xs = xs + _pairs(x_ptr, xp_ptr, rows, rows < K // 8, shape, BF16, PRE_X, ASM)
        if READ_ONLY:
            for c in tl.static_range(C):
                bits = bits ^ ws[c]
        else:
            s = tl.load(s_ptr + (t * BLOCK_K // 128) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            s = tl.broadcast_to(s[None, :], shape)
            if ASM:
                consts = dequant_constants(shape)
                acc = tl.inline_asm_elementwise(
                    PTX, CONSTRAINTS, ws + xs + (s, acc) + consts, dtype=tl.float32, is_pure=True, pack=1
                )
            else:
                acc = _emulated_chain(ws, xs, s, acc, C)
        ws = nxt
    if READ_ONLY:  # noqa: SIM108
        y = tl.sum(bits, axis=0).to(tl.float32)
    else:
        y = tl.sum(acc, axis=0) * OUT_SCALE
    split_k_store(y[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N)


def activation_pairs(x: torch.Tensor) -> torch.Tensor:
    """int32 ``[K / 8, 4]``: fp16 pair ``j`` of word row ``r`` is ``(x[8 r + j], x[8 r + j + 4])``, low half first."""
    h = x.reshape(-1, 2, 4).to(torch.float16)  # [rows, (j, j + 4) halves, j]
    return h.transpose(1, 2).contiguous().view(torch.int32).reshape(-1, 4)


def run_variant(
    x: torch.Tensor,
    xp: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    chain: int = 1,
    read_only: bool = False,
    pre_x: bool = False,
    evict: bool = False,
    block_n: int = 256,
    block_k: int = 64,
    num_warps: int = 4,
    asm: bool = True,
) -> torch.Tensor:
    k, n = x.shape[1], qweight.shape[1]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid, part, cnt = tk._fixed_split_k(x, 1, n, k, block_n, block_k, None, tk._PAIRED_MIN_TILES)
    _variant_kernel[grid](
        x,
        xp,
        qweight,
        scales,
        y,
        part,
        cnt,
        n,
        k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        C=chain,
        READ_ONLY=read_only,
        PRE_X=pre_x,
        EVICT=evict,
        BF16=x.dtype == torch.bfloat16,
        ASM=asm,
        PTX=_PTX[chain],
        CONSTRAINTS=_CONSTRAINTS[chain],
        num_warps=num_warps,
        num_stages=1,
    )
    return y


VARIANTS = {
    "read": {"read_only": True},
    "chain1": {"chain": 1},
    "chain2": {"chain": 2},
    "chain4": {"chain": 4},
    "chain4_prex": {"chain": 4, "pre_x": True},
    "chain1_prex": {"chain": 1, "pre_x": True},
    "chain1_evict": {"chain": 1, "evict": True},
    "read_evict": {"read_only": True, "evict": True},
    "read_n512": {"read_only": True, "block_n": 512},
    "chain4_n512": {"chain": 4, "block_n": 512},
    "chain4_n512_k32": {"chain": 4, "block_n": 512, "block_k": 32},
    "chain2_n512_k32": {"chain": 2, "block_n": 512, "block_k": 32},
    "chain4_n128_w2": {"chain": 4, "block_n": 128, "num_warps": 2},
}


def bench(name: str, k: int, n: int, rep: int) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    xp = activation_pairs(x)
    qweight = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
    scales = [(torch.rand(k // GROUP, n, device="cuda") * 0.01 + 1e-3).half() for _ in range(COPIES)]
    dense = [tk.dequantize(qweight[i], scales[i], 4, GROUP, dtype=dtype).contiguous() for i in range(COPIES)]
    exact = x.float() @ tk.dequantize(qweight[0], scales[0], 4, GROUP, dtype=torch.float32).t()
    weight_bytes = k * n // 2 + (k // GROUP) * n * 2
    row: dict = {"layer": name, "K": k, "N": n, "cublas_us": _time_us(lambda i: F.linear(x, dense[i]), rep)}
    times = {"lib": _time_us(lambda i: tk.matmul_paired(x, qweight[i], scales[i], 4, GROUP), rep)}
    errors = {"lib": float((tk.matmul_paired(x, qweight[0], scales[0]).float() - exact).norm() / exact.norm())}
    for label, opts in VARIANTS.items():
        times[label] = _time_us(lambda i, o=opts: run_variant(x, xp, qweight[i], scales[i], **o), rep)
        if not opts.get("read_only"):
            y = run_variant(x, xp, qweight[0], scales[0], **opts)
            errors[label] = float((y.float() - exact).norm() / exact.norm())
    row["us"] = times
    row["rel_err"] = errors
    row["TBps"] = {label: weight_bytes / us / 1e6 for label, us in times.items()}
    row["vs_cublas"] = {label: row["cublas_us"] / us for label, us in times.items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep", type=int, default=200, help="do_bench_cudagraph budget (ms) per timing")
    ap.add_argument("--shapes", nargs="*", default=["gate_up", "down"], choices=list(SHAPES))
    args = ap.parse_args()
    rows = []
    for name in args.shapes:
        k, n = SHAPES[name]
        row = bench(name, k, n, args.rep)
        rows.append(row)
        print(f"{name}: cuBLAS {row['cublas_us']:.1f} us", flush=True)
        for label, us in row["us"].items():
            err = row["rel_err"].get(label)
            print(
                f"  {label:<14} {us:6.1f} us  {row['TBps'][label]:.2f} TB/s  {row['vs_cublas'][label]:.2f}x"
                + (f"  err {err:.2e}" if err is not None else ""),
                flush=True,
            )
    write_results(args.out, "w4a16_gemv_anatomy.json", {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
