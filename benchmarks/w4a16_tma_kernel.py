"""The W4A16 one-row paired GEMV with its words read by TMA (a tensor descriptor) in a software-pipelined loop of
``STAGES`` K tiles (Triton pipelines the descriptor loads through shared memory and the activation and scale
loads through ``cp.async``), for ``w4a16_tma.py``; plain ``[ROWS, BLOCK_N]`` tiles, group sizes that cover whole
K tiles, activations within fp16's range (no range read). Not a library kernel: on an H200 it was no faster
than the register-loaded ``paired_gemv``."""

import triton
import triton.language as tl
from salaquant.kernels.paired_f16 import f16_pair, halves
from salaquant.kernels.w4a16.paired_gemv import OUT_SCALE, word_dot
from salaquant.kernels.w4a16.split_k import finish_split_k, k_slice


@triton.jit
def _tiles(
    x_ptr, w_desc, s_ptr, t_start, t_end, col0, N, K,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The fp32 ``[ROWS, BLOCK_N]`` partial sums of K tiles ``t_start .. t_end``, the words by TMA."""
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    for t in tl.range(t_start, t_end, num_stages=STAGES):
        words = w_desc.load([t * ROWS, col0])
        rows = t * ROWS + offs_r
        mask_r = rows < K // 8
        xb = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * 4
        v01 = f16_pair(tl.load(xb + 0, mask=mask_r, other=0), BF16, ASM)
        v23 = f16_pair(tl.load(xb + 1, mask=mask_r, other=0), BF16, ASM)
        v45 = f16_pair(tl.load(xb + 2, mask=mask_r, other=0), BF16, ASM)
        v67 = f16_pair(tl.load(xb + 3, mask=mask_r, other=0), BF16, ASM)
        shape: tl.constexpr = (ROWS, BLOCK_N)
        p0 = tl.broadcast_to(halves(v01, v45, False)[:, None], shape)
        p1 = tl.broadcast_to(halves(v01, v45, True)[:, None], shape)
        p2 = tl.broadcast_to(halves(v23, v67, False)[:, None], shape)
        p3 = tl.broadcast_to(halves(v23, v67, True)[:, None], shape)
        g = t * BLOCK_K // GROUP_SIZE
        s = tl.broadcast_to(tl.load(s_ptr + g * N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :], shape)
        acc = word_dot(words, p0, p1, p2, p3, s, acc, ASM)
    return acc


@triton.jit
def paired_tma_kernel(
    x_ptr, w_desc, s_ptr, y_ptr, part_ptr, cnt_ptr, N, K,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """``matmul_paired``'s kernel without the range read: the activations must lie within fp16's range."""
    col0 = tl.program_id(0) * BLOCK_N
    out_cols = col0 + tl.arange(0, BLOCK_N)
    t_start, t_end = k_slice(K, BLOCK_K)
    acc = _tiles(x_ptr, w_desc, s_ptr, t_start, t_end, col0, N, K, GROUP_SIZE, BLOCK_N, BLOCK_K, BF16, ASM, STAGES)
    y = tl.sum(acc, axis=0) * OUT_SCALE
    if tl.num_programs(1) == 1:
        tl.store(y_ptr + out_cols, y.to(y_ptr.dtype.element_ty), mask=out_cols < N)
    else:
        tl.store(part_ptr + tl.program_id(1) * N + out_cols, y, mask=out_cols < N)
        finish_split_k(y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), out_cols, 1, N, N)
