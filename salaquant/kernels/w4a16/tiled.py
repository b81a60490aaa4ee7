"""The tiled W4A16 GEMM for 16 < M <= ``TILED_MAX_M`` (``matmul_tiled``): output tiles, each over the whole K or,
where the output tiles alone leave SMs idle, over one split of K (``../split_k.py``: axis 1 of the grid enumerates
the splits, the last split of a tile to arrive sums the partials).

Scale modes, fixed at compile time: ``GROUP_SIZE <= 0`` means one group (scaled once at the end); a multiple
of ``BLOCK_K`` means one scale row per K tile; otherwise one scale row per word row (``GROUP_SIZE`` is a
multiple of ``32 / BITS``, so the values of one word share a group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..split_k import k_slice, store_split_k
from ..tile_order import grouped_tile
from .autotune import INTERPRET, bench, config

__all__ = ["TILED_CONFIGS", "prune_tiled", "tiled_kernel"]

if INTERPRET:
    TILED_CONFIGS = [config(4, 1, BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, EXPAND=True)]
else:
    TILED_CONFIGS = [
        config(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EXPAND=True),
        config(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EXPAND=False),
        config(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EXPAND=True),
        config(8, 2, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
        config(8, 3, BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, EXPAND=True),
        config(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
        config(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, EXPAND=False),
        config(4, 3, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, EXPAND=True),
    ]


def prune_tiled(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles much taller than the activation (``M_BUCKET`` is M rounded up to a power of two)."""
    cap = max(32, named_args["M_BUCKET"])
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= cap]
    return kept or configs[:1]


@triton.autotune(
    configs=TILED_CONFIGS,
    key=["M_BUCKET", "N", "K", "BITS", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": prune_tiled},
    do_bench=bench,
)
@triton.jit
def tiled_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    MAGIC,
    M_BUCKET,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXPAND: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """One ``tl.dot`` per K tile on the dequantized ``[BLOCK_K, BLOCK_N]`` weight tile in natural K order.

    The tile's word of K row ``k`` is word row ``k // PACK``: with ``EXPAND`` the packed ``[BLOCK_K / PACK,
    BLOCK_N]`` words are loaded once and each row repeated ``PACK`` times in registers; without it every K row
    loads its word (repeated addresses, fewer register shuffles, ``PACK`` times the shared-memory staging).
    """
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = GROUP_SIZE <= 0
    TILE_SCALE: tl.constexpr = (not ONE_GROUP) and (GROUP_SIZE % BLOCK_K == 0)
    dtype = x_ptr.dtype.element_ty

    # Grouped launch order: GROUP_M row tiles sweep the column tiles together, so weight tiles stay in L2.
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_m = offs_m.to(tl.int64)[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, ROWS)
    shifts = ((offs_k % PACK) * BITS)[:, None]
    if ONE_GROUP:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    first, last = k_slice(K, BLOCK_K)
    for kt in range(first, last):
        k0 = kt * BLOCK_K
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(x_ptr + rows_m * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if EXPAND:
            rows = k0 // PACK + offs_r
            w_mask = (rows < K // PACK)[:, None] & mask_n[None, :]
            packed = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            words = tl.reshape(tl.broadcast_to(packed[:, None, :], (ROWS, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            w_mask = mask_k[:, None] & mask_n[None, :]
            words = tl.load(w_ptr + (kk // PACK)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
        code = (words >> shifts) & ((1 << BITS) - 1)
        w = (code | MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
        if TILE_SCALE:
            s = tl.load(s_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        elif not ONE_GROUP:
            s_mask = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + (kk // GROUP_SIZE)[:, None] * N + offs_n[None, :], mask=s_mask, other=0.0)
            s = s.to(tl.float32)
        acc = tl.dot(a, (w * s).to(dtype), acc, input_precision=DOT_PRECISION)
    store_split_k(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym)
