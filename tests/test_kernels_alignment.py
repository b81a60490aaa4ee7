"""Kernels that read 16-bit activations as int32 pairs get 4-byte aligned rows: ``pair_aligned`` against views at
odd element offsets and odd row strides, and the launchers' arguments checked as they reach the kernels (a
misaligned int32 load faults on a GPU; the interpreter would not notice)."""

from __future__ import annotations

import pytest
import torch

from salaquant.formats.modelopt_nvfp4.numerics import quantize_nvfp4
from salaquant.kernels.host import pair_aligned
from salaquant.kernels.w4a16 import w4a16_matmul_reference

pytestmark = pytest.mark.random_inputs


def _odd_view(m: int, k: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Activations ``[m, k]`` whose first element sits 2 bytes past a 4-byte boundary and whose rows are k + 1 apart."""
    big = torch.randn(m, k + 1, dtype=torch.float32).to(dtype)
    x = big[:, 1:]
    assert x.data_ptr() % 4 == 2 and x.stride() == (k + 1, 1)
    return x


def test_pair_aligned_copies_only_what_it_must() -> None:
    aligned = torch.randn(3, 64).half()
    assert pair_aligned(aligned) is aligned
    fp32_view = aligned.float()[:, 1:]  # fp32: every element is 4-byte aligned
    assert pair_aligned(fp32_view) is fp32_view
    one_row = torch.randn(1, 65).half()[:, :64]  # odd row stride, but a single row
    assert pair_aligned(one_row) is one_row
    for x in (_odd_view(3, 64), torch.randn(3, 65).half()[:, :64], torch.randn(64, 3).half().t()):
        y = pair_aligned(x)
        assert y.data_ptr() % 4 == 0 and y.stride(-1) == 1 and (y.shape[0] == 1 or y.stride(0) % 2 == 0)
        assert torch.equal(y, x)


class _AlignmentSpy:
    """Stands in for a Triton kernel: checks that the activations (first argument) are pair-aligned, then launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(x: torch.Tensor, *args, **kwargs):
            assert x.data_ptr() % 4 == 0 and (x.shape[0] == 1 or x.stride(0) % 2 == 0), "misaligned activations"
            self.launches += 1
            return self.kernel[grid](x, *args, **kwargs)

        return launch


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 3])
def test_w4a16_launchers_align_the_activations(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    from salaquant.kernels.w4a16 import triton_kernels as tk

    gen = torch.Generator().manual_seed(0)
    k, n = 128, 32
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(1, n, generator=gen) * 0.02 + 0.002).half()
    x = _odd_view(m, k)
    name, run = ("paired_gemv_kernel", tk.matmul_paired) if m == 1 else ("mma_rows_kernel", tk.matmul_mma_rows)
    spy = _AlignmentSpy(getattr(tk, name))
    monkeypatch.setattr(tk, name, spy)
    y = run(x, qweight, scales, 4, 128, split_k=1)
    assert spy.launches == 1
    ref = w4a16_matmul_reference(x.contiguous(), qweight, scales, 4, 128)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.interpreter
def test_nvfp4_launchers_align_the_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    from salaquant.kernels.nvfp4 import nvfp4_matmul_reference
    from salaquant.kernels.nvfp4 import triton_kernels as nk

    gen = torch.Generator().manual_seed(0)
    k, n = 128, 32
    q = quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05)
    for m, name in ((1, "nvfp4_paired_gemv_kernel"), (3, "mma_rows_kernel")):
        x = _odd_view(m, k)
        spy = _AlignmentSpy(getattr(nk, name))
        monkeypatch.setattr(nk, name, spy)
        if m == 1:
            y = nk.nvfp4_matmul_triton(x, q.weight, q.weight_scale, q.weight_scale_2)
        else:
            rows = nk.NVFP4Config("rows", block_n=128, split_k=1, num_warps=4, num_stages=1)
            y = nk.nvfp4_matmul_triton(x, q.weight, q.weight_scale, q.weight_scale_2, config=rows)
        assert spy.launches == 1
        ref = nvfp4_matmul_reference(x.contiguous(), q.weight, q.weight_scale, q.weight_scale_2)
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-3)
