import json
import math

import pytest
import torch
import torch.nn.functional as F

from salaquant.model.config import DEFAULT_SPARSE_CONFIG
from salaquant.model.sparse_attention import (
    SparseParams,
    block_scores,
    block_sparse_attention,
    compress_keys,
    drop_forced_blocks,
    extend_compressed,
    infllm_v2_attention,
    num_compressed,
    select_blocks,
    stage1_scores,
)

# Scaled-down settings: K1 (8, 4), K2 (32, 16), 16-token blocks, 1 local block, 5 blocks in total
# (3 forced: init, previous, current; 2 chosen by score).
TINY = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=16, topk=4)
# Same windows, but enough blocks to select everything for Tk <= 17 * 16.
TINY_ALL = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=16, topk=16)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qkv(b: int, tq: int, tk: int, hkv: int, g: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    q = _randn(b, tq, hkv * g, d, seed=seed)
    k = _randn(b, tk, hkv, d, seed=seed + 1)
    v = _randn(b, tk, hkv, d, seed=seed + 2)
    return q, k, v


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with GQA by repeat_interleave; ``mask``: bool [B, Hq, Tq, Tk] or broadcastable."""
    g = q.shape[2] // k.shape[2]
    kr = k.repeat_interleave(g, dim=2).transpose(1, 2).float()
    vr = v.repeat_interleave(g, dim=2).transpose(1, 2).float()
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kr, vr, attn_mask=mask)
    return out.transpose(1, 2)


def _causal_mask(tq: int, tk: int) -> torch.Tensor:
    q_pos = torch.arange(tk - tq, tk)[:, None]
    return torch.arange(tk)[None, :] <= q_pos


def test_params() -> None:
    # sparse_config as the published MiniCPM-SALA config.json writes it
    sala = json.loads(
        '{"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64, "window_size": 2048, '
        '"topk": 64, "use_nope": false, "dense_len": 8192}'
    )
    p = SparseParams.from_config(sala)
    assert p == SparseParams() == SparseParams.from_config(DEFAULT_SPARSE_CONFIG)
    assert p.local_blocks == 32 and p.total_topk == 96
    assert (p.kernel_size2, p.kernel_stride2) == (128, 64)
    assert TINY.local_blocks == 1 and TINY.total_topk == 5
    # 96 selected >= 1 init + 32 local + own block; topk=1 leaves 33 < 34: a forced block can be dropped
    assert p.keeps_forced_blocks and not SparseParams(topk=1).keeps_forced_blocks
    assert SparseParams(topk=2).keeps_forced_blocks
    assert SparseParams.from_config({"topk": 8}).total_topk == 40
    with pytest.raises(ValueError):
        SparseParams(block_size=60, kernel_stride=16)


@pytest.mark.parametrize(("tk", "size", "stride"), [(37, 8, 4), (40, 8, 4), (7, 8, 4), (8, 8, 4), (50, 12, 5)])
def test_compress_keys_matches_loop(tk: int, size: int, stride: int) -> None:
    k = _randn(2, tk, 3, 5, seed=0).to(torch.bfloat16)
    out = compress_keys(k, size, stride)
    expected = []
    start = 0
    while start + size <= tk:
        expected.append(k[:, start : start + size].float().sum(dim=1) / size)
        start += stride
    assert out.dtype == torch.bfloat16  # the keys' dtype, as the model's own mean returns
    assert out.shape == (2, len(expected), 3, 5)
    assert num_compressed(tk, size, stride) == len(expected)
    if expected:
        # the fp32 mean rounded once to bf16: at most one bf16 step apart (summation order)
        want = torch.stack(expected, dim=1)
        torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=2**-7, atol=0)
        # the model's formulation: windows stacked, then torch's bf16 mean over the window axis
        windows = torch.stack([k[:, i * stride : i * stride + size] for i in range(len(expected))], dim=1)
        torch.testing.assert_close(out, windows.mean(dim=2), rtol=2**-7, atol=0)
    k32 = k.float()
    assert compress_keys(k32, size, stride).dtype == torch.float32


@pytest.mark.parametrize(("size", "stride"), [(8, 4), (32, 16)])
def test_extend_compressed_incremental(size: int, stride: int) -> None:
    k = _randn(1, 90, 2, 4, seed=1)
    comp = torch.zeros(1, 0, 2, 4)
    for t in range(1, 91):
        comp = extend_compressed(k[:, :t], comp, size, stride)
        n = (t - size) // stride + 1 if t >= size else 0
        assert comp.shape[1] == n
        for i in range(n):
            torch.testing.assert_close(comp[:, i], k[:, stride * i : stride * i + size].mean(dim=1))
    # several new tokens at once (chunked prefill)
    part = compress_keys(k[:, :41], size, stride)
    torch.testing.assert_close(extend_compressed(k, part, size, stride), compress_keys(k, size, stride))


def _stage1_loop(q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, q_start: int, p: SparseParams) -> torch.Tensor:
    b_size, tq, hq, d = q.shape
    hkv = k1.shape[2]
    g_size = hq // hkv
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(b_size, hkv, tq, k1.shape[1], dtype=torch.float64)
    for b in range(b_size):
        for i in range(tq):
            t = q_start + i
            vis2 = [j for j in range(k2.shape[1]) if 4 * p.kernel_stride * j + 4 * p.kernel_size - 1 <= t]
            vis1 = [j for j in range(k1.shape[1]) if p.kernel_stride * j + p.kernel_size - 1 <= t]
            if not vis2:
                continue
            for h in range(hq):
                g = h // g_size
                qh = q[b, i, h].double()
                lse = torch.logsumexp(scale * (k2[b, vis2, g].double() @ qh), dim=0)
                out[b, g, i, vis1] += torch.exp(scale * (k1[b, vis1, g].double() @ qh) - lse)
    return out


@pytest.mark.parametrize(("tq", "chunk"), [(300, 64), (45, 512)])
def test_stage1_matches_loop(tq: int, chunk: int) -> None:
    tk, hkv, g, d = 300, 2, 2, 8
    q = _randn(1, tq, hkv * g, d, seed=2)
    k1 = _randn(1, num_compressed(tk, 8, 4), hkv, d, seed=3)
    k2 = _randn(1, num_compressed(tk, 32, 16), hkv, d, seed=4)
    q_start = tk - tq
    scores = stage1_scores(q, k1, k2, q_start, TINY, query_chunk=chunk)
    expected = _stage1_loop(q, k1, k2, q_start, TINY)
    assert scores.dtype == torch.float32
    assert scores.shape == (1, hkv, tq, k1.shape[1])
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-6)
    if q_start == 0:
        # first K2 window ends at token 31: earlier rows are 0, row 31 is not
        assert (scores[:, :, :31] == 0).all()
        assert (scores[:, :, 31, :7] > 0).all() and (scores[:, :, 31, 7:] == 0).all()


@pytest.mark.parametrize("tk", [300, 289])
def test_block_scores_matches_hand_max(tk: int) -> None:
    tq = 120
    q_start = tk - tq
    n1 = num_compressed(tk, 8, 4)
    scores = _randn(2, 1, tq, n1, seed=5).abs()
    out = block_scores(scores, q_start, tk, TINY)
    n_blocks = math.ceil(tk / 16)
    assert out.shape == (2, 1, tq, n_blocks)
    for i in range(tq):
        t = q_start + i
        qb = t // 16
        for blk in range(n_blocks):
            if blk < 1 or qb - 1 <= blk <= qb:
                assert torch.isinf(out[:, 0, i, blk]).all() and (out[:, 0, i, blk] > 0).all()
                continue
            # K1 windows [4w, 4w + 8) overlapping the block's tokens [16 blk, 16 blk + 16)
            windows = [w for w in range(n1) if 4 * w < 16 * (blk + 1) and 4 * w + 8 > 16 * blk]
            expected = scores[:, 0, i, windows].amax(dim=-1) if windows else torch.zeros(2)
            torch.testing.assert_close(out[:, 0, i, blk], expected)


def test_select_blocks_ties_and_future() -> None:
    p = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=0, block_size=16, window_size=0, topk=3)
    scores = torch.tensor([1.0, 5.0, 5.0, 3.0, 5.0, 0.0]).view(1, 1, 1, 6)
    # query in block 5: the three 5.0 entries, lower indices first
    assert select_blocks(scores, 80, p).tolist() == [[[[1, 2, 4]]]]
    # query in block 2: block 4 is in the future
    assert select_blocks(scores, 40, p).tolist() == [[[[1, 2, -1]]]]
    flat = torch.zeros(1, 1, 1, 6)
    assert select_blocks(flat, 95, p).tolist() == [[[[0, 1, 2]]]]
    # many ties in a long row: every third block scores 1
    many = torch.zeros(1, 1, 1, 400)
    many[..., ::3] = 1.0
    p5 = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=0, block_size=16, window_size=0, topk=5)
    assert select_blocks(many, 16 * 400 - 1, p5).tolist() == [[[[0, 3, 6, 9, 12]]]]
    forced = torch.tensor([math.inf, 0.0, math.inf, math.inf, 0.0]).view(1, 1, 1, 5)
    p2 = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=0, block_size=16, window_size=0, topk=2)
    assert select_blocks(forced, 79, p2).tolist() == [[[[0, 2]]]]
    # fewer blocks than total_topk: keep them all
    out = select_blocks(torch.rand(1, 2, 1, 2), 20, p)
    assert out.dtype == torch.int64 and out.tolist() == [[[[0, 1]], [[0, 1]]]]


def test_drop_forced_blocks_keeps_the_rest() -> None:
    """Hand-made rows: forced blocks (init 0, window qb-2..qb) leave, the others stay, longest row kept."""
    small = SparseParams(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=32, topk=4)
    idx = torch.tensor([[[[0, 3, 7, 8, 9], [0, 1, 2, 5, 9], [0, 6, 7, 8, 9]]]])
    # block 16, init 1, local 2; queries at 158, 159, 160 -> qb 9, 9, 10
    got = drop_forced_blocks(idx, 158, small)
    assert got.dtype == torch.int32 and got.shape == (1, 1, 3, 3)  # the longest row keeps 3
    assert got[0, 0, 0].tolist() == [3, -1, -1]
    assert got[0, 0, 1].tolist() == [5, 2, 1]
    assert got[0, 0, 2].tolist() == [7, 6, -1]
    assert drop_forced_blocks(torch.tensor([[[[0, 9]]]]), 150, small).tolist() == [[[[-1]]]]  # nothing left


@pytest.mark.parametrize(
    ("params", "tk", "tq"),
    [
        (TINY_ALL, 200, 200),  # prefill
        (TINY_ALL, 200, 37),  # chunked prefill with cache
        (TINY_ALL, 200, 1),  # decode
        (TINY_ALL, 45, 45),  # no K2 window for most rows
        (SparseParams(), 700, 700),  # SALA settings, 11 blocks
        (SparseParams(), 700, 1),
    ],
)
def test_sparse_equals_dense_when_all_blocks_selected(params: SparseParams, tk: int, tq: int) -> None:
    assert params.total_topk >= math.ceil(tk / params.block_size)
    q, k, v = _qkv(2, tq, tk, 2, 3, 16, seed=6)
    out = infllm_v2_attention(q, k, v, params)
    assert out.shape == q.shape and out.dtype == q.dtype
    if tq == tk:
        kr = k.repeat_interleave(3, dim=2).transpose(1, 2)
        vr = v.repeat_interleave(3, dim=2).transpose(1, 2)
        expected = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=True).transpose(1, 2)
    else:
        expected = _dense(q, k, v, _causal_mask(tq, tk))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sparse_bf16_output_dtype() -> None:
    q, k, v = _qkv(1, 64, 64, 1, 2, 8, seed=7)
    out = infllm_v2_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), TINY_ALL)
    assert out.dtype == torch.bfloat16
    expected = _dense(q.bfloat16(), k.bfloat16(), v.bfloat16(), _causal_mask(64, 64))
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def _mask_from_blocks(block_idx: torch.Tensor, q_start: int, tk: int, g: int, block_size: int) -> torch.Tensor:
    """bool [B, Hq, Tq, Tk]: key s visible iff block s // block_size is listed and s <= t."""
    b_size, hkv, tq, _ = block_idx.shape
    mask = torch.zeros(b_size, hkv, tq, tk, dtype=torch.bool)
    for b in range(b_size):
        for h in range(hkv):
            for i in range(tq):
                t = q_start + i
                for blk in block_idx[b, h, i].tolist():
                    if blk >= 0:
                        mask[b, h, i, blk * block_size : min((blk + 1) * block_size, t + 1)] = True
    return mask.repeat_interleave(g, dim=1)


@pytest.mark.parametrize(("tk", "tq"), [(300, 300), (300, 1), (300, 20)])
def test_sparse_with_dropped_blocks_equals_masked_dense(tk: int, tq: int) -> None:
    hkv, g = 2, 2
    q, k, v = _qkv(2, tq, tk, hkv, g, 8, seed=8)
    q_start = tk - tq
    k1 = compress_keys(k, TINY.kernel_size, TINY.kernel_stride)
    k2 = compress_keys(k, TINY.kernel_size2, TINY.kernel_stride2)
    idx = select_blocks(block_scores(stage1_scores(q, k1, k2, q_start, TINY), q_start, tk, TINY), q_start, TINY)
    assert idx.shape == (2, hkv, tq, TINY.total_topk)
    # the last query sees 19 blocks but keeps 5, two of them chosen by score
    assert ((idx[:, :, -1] >= 0).sum(-1) == 5).all()
    assert ((idx[:, :, -1] >= 1) & (idx[:, :, -1] < 17)).sum(-1).eq(2).all()
    # the chosen blocks vary across queries and heads
    assert len({tuple(row) for row in idx[..., 1:3].reshape(-1, 2).tolist()}) > 2
    mask = _mask_from_blocks(idx, q_start, tk, g, TINY.block_size)
    expected = _dense(q, k, v, mask)
    out = block_sparse_attention(q, k, v, idx, q_start, TINY, query_chunk=64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(infllm_v2_attention(q, k, v, TINY), expected, rtol=1e-5, atol=1e-5)
    full = _dense(q, k, v, _causal_mask(tq, tk))
    assert (out[:, -1] - full[:, -1]).abs().max() > 1e-3


def test_block_sparse_attention_arbitrary_indices() -> None:
    tk, tq, hkv, g = 100, 30, 2, 2
    q, k, v = _qkv(1, tq, tk, hkv, g, 8, seed=9)
    q_start = tk - tq
    gen = torch.Generator().manual_seed(10)
    # random picks among blocks 0..6 (some in the future of early rows), with -1 padding
    idx = torch.randint(-1, 7, (1, hkv, tq, 3), generator=gen)
    idx[..., 0] = torch.randint(0, 5, (1, hkv, tq), generator=gen)  # every row keeps a past block
    expected = _dense(q, k, v, _mask_from_blocks(idx, q_start, tk, g, 16))
    out = block_sparse_attention(q, k, v, idx, q_start, TINY, query_chunk=7)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    empty = torch.full((1, hkv, tq, 2), -1)
    assert (block_sparse_attention(q, k, v, empty, q_start, TINY) == 0).all()


def test_decode_with_incremental_compression() -> None:
    tk, hkv, g = 260, 1, 4
    q, k, v = _qkv(1, 1, tk, hkv, g, 8, seed=11)
    k1 = compress_keys(k[:, : tk - 5], 8, 4)
    k2 = compress_keys(k[:, : tk - 5], 32, 16)
    for t in range(tk - 4, tk + 1):
        k1 = extend_compressed(k[:, :t], k1, 8, 4)
        k2 = extend_compressed(k[:, :t], k2, 32, 16)
    out = infllm_v2_attention(q, k, v, TINY, k1=k1, k2=k2)
    q_start = tk - 1
    idx = select_blocks(
        block_scores(
            stage1_scores(q, compress_keys(k, 8, 4), compress_keys(k, 32, 16), q_start, TINY),
            q_start,
            tk,
            TINY,
        ),
        q_start,
        TINY,
    )
    expected = _dense(q, k, v, _mask_from_blocks(idx, q_start, tk, g, 16))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
