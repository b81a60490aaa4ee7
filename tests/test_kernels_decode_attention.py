"""The split-key decode attention kernel (``salaquant.kernels.decode_attention``) against a plain fp32 softmax."""

from __future__ import annotations

import math

import pytest
import torch

from salaquant.kernels.decode_attention import masked_decode_attention

pytestmark = pytest.mark.random_inputs


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64 attention of each (row, KV head)'s queries over its kept keys, looped, from the definition."""
    b, hkv, g, d = q.shape
    out = torch.empty(b, hkv, g, d, dtype=torch.float64)
    for i in range(b):
        for h in range(hkv):
            keys = mask[i, h].nonzero()[:, 0]
            kk, vv = k[i, keys, h].double(), v[i, keys, h].double()
            w = torch.softmax(q[i, h].double() @ kk.T * scale, dim=-1)
            out[i, h] = w @ vv
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("b", "hkv", "g", "c", "d"), [(2, 2, 16, 200, 32), (1, 3, 3, 64, 8), (3, 1, 5, 129, 24)])
def test_kernel_matches_reference(dtype: torch.dtype, b: int, hkv: int, g: int, c: int, d: int) -> None:
    """Random masks (one head keeping a single key, one keeping all), a key count that is not a multiple of the
    block, G below the 16-row tile, head dims below the 16-wide tile and not a power of two, and the static cache's
    [B, C, Hkv, D] layout cut from a larger buffer."""
    q = torch.randn(b, hkv, g, d).to(dtype)
    kbuf = (torch.randn(b, c + 7, hkv, d) * 2).to(dtype)
    vbuf = torch.randn(b, c + 7, hkv, d).to(dtype)
    k, v = kbuf[:, :c], vbuf[:, :c]  # strided views, as the cache's first C positions
    mask = torch.rand(b, hkv, c) < 0.4
    mask[0, 0] = False
    mask[0, 0, c - 1] = True  # a single key, in the last block
    mask[-1, -1] = True
    scale = 1 / math.sqrt(d)
    got = masked_decode_attention(q, k, v, mask, scale)
    assert got.dtype == dtype and got.shape == (b, hkv, g, d)
    ref = _reference(q, k, v, mask, scale)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got[0, 0].double(), v[0, c - 1, 0].double().expand(g, d), rtol=tol, atol=tol)


@pytest.mark.interpreter
def test_all_masked_gives_nan_and_bad_shapes_are_refused() -> None:
    q = torch.randn(1, 1, 4, 16)
    k = v = torch.randn(1, 70, 1, 16)
    mask = torch.zeros(1, 1, 70, dtype=torch.bool)
    assert torch.isnan(masked_decode_attention(q, k, v, mask, 0.25)).all()
    with pytest.raises(ValueError, match="mask"):
        masked_decode_attention(q, k, v, mask[:, :, :-1], 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        masked_decode_attention(torch.randn(1, 1, 4, 32)[..., ::2], k, v, mask, 0.25)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["dense", "sparse", "auto"])
def test_static_cache_decode_attention_takes_the_kernel(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``static_cache.decode_attention`` on its Triton path gives its reference path's output and cache, with rows
    at different lengths (in the sparse mode the InfLLM-v2 selection decides the mask)."""
    from salaquant.kernels.decode_attention import triton_kernels
    from salaquant.model.sparse_attention import SparseParams
    from salaquant.model.static_cache import StaticSparseCache, decode_attention

    calls = []
    kernel = triton_kernels.masked_decode_attention_triton
    monkeypatch.setattr(triton_kernels, "masked_decode_attention_triton", lambda *a: calls.append(1) or kernel(*a))

    params = SparseParams(kernel_size=16, kernel_stride=8, init_blocks=1, block_size=32, window_size=32, topk=3)
    b, cap, hkv, g, d = 3, 320, 2, 4, 32
    lengths = torch.tensor([300, 17, 150])
    caches = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        k, v = (torch.randn(b, cap, hkv, d, generator=gen).half() for _ in range(2))
        k1 = torch.randn(b, 39, hkv, d, generator=gen).half()
        k2 = torch.randn(b, 19, hkv, d, generator=gen).half()
        caches.append(StaticSparseCache(k, v, k1, k2, lengths.clone()))
    q = torch.randn(b, 1, hkv * g, d).half()
    kn, vn = torch.randn(b, 1, hkv, d).half(), torch.randn(b, 1, hkv, d).half()
    ref = decode_attention(q, kn, vn, caches[0], params, 200, mode, backend="reference")
    got = decode_attention(q, kn, vn, caches[1], params, 200, mode, backend="triton")
    assert calls == [1]
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)
    for a, e in zip((caches[1].k, caches[1].v, caches[1].k1), (caches[0].k, caches[0].v, caches[0].k1), strict=True):
        assert torch.equal(a, e)


def _reference_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """fp64 masked softmax attention, vectorised over rows and heads (the GPU test's sizes)."""
    s = torch.einsum("bhgd,bchd->bhgc", q.double(), k.double()) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.einsum("bhgc,bchd->bhgd", torch.softmax(s, dim=-1), v.double())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "c", "lengths"), [(1, 8448, [8193]), (16, 2304, list(range(2049, 2305, 16)))])
def test_gpu_kernel_at_the_minicpm4_shape(dtype: torch.dtype, b: int, c: int, lengths: list[int]) -> None:
    """The real layers' 2 KV heads of 16 query heads, head_dim 128, over a static buffer filled to each row's
    length (one 8K row; 16 rows of different lengths), with sparse-looking masks on half the heads."""
    hkv, g, d = 2, 16, 128
    q = torch.randn(b, hkv, g, d, device="cuda").to(dtype)
    k = (torch.randn(b, c, hkv, d, device="cuda") * 2).to(dtype)
    v = torch.randn(b, c, hkv, d, device="cuda").to(dtype)
    pos = torch.arange(c, device="cuda")
    mask = (pos[None, :] < torch.tensor(lengths, device="cuda")[:, None])[:, None, :].expand(b, hkv, c).clone()
    mask[:, 1] &= torch.rand(b, c, device="cuda") < 0.3
    scale = d**-0.5
    got = masked_decode_attention(q, k, v, mask, scale)
    torch.cuda.synchronize()
    ref = _reference_batched(q, k, v, mask, scale)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < (4e-3 if dtype == torch.bfloat16 else 5e-4), err
