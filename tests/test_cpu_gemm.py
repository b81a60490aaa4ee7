"""bf16 CPU linears through float32 (`salaquant.cpu_gemm`): the same values as an exact product rounded to bf16,
other calls untouched, and the processor flags read as Linux lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from salaquant import cpu_gemm


def _exact_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).to(torch.bfloat16)


@pytest.fixture(autouse=True)
def torch_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own ``F.linear`` for the test (the session's conftest may have replaced it on this CPU)."""
    monkeypatch.setattr(F, "linear", cpu_gemm._TORCH_LINEAR)


@pytest.fixture
def fp32_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: False)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_the_exact_product_rounded(fp32_mode: None, bias: bool) -> None:
    x = torch.randn(3, 37, 96).to(torch.bfloat16)
    w = torch.randn(80, 96).to(torch.bfloat16)
    b = torch.randn(80).to(torch.bfloat16) if bias else None
    with cpu_gemm.bf16_linears_in_fp32() as on:
        assert on
        y = F.linear(x, w, b)
        y_kw = F.linear(input=x, weight=w, bias=b)
        with cpu_gemm.bf16_linears_in_fp32() as inner:  # nested: the outer context keeps it
            assert inner
        assert torch.equal(F.linear(x, w, b), y)
    assert F.linear is cpu_gemm._TORCH_LINEAR  # restored
    assert y.dtype == torch.bfloat16 and y.shape == (3, 37, 80)
    assert torch.equal(y, y_kw)
    ref = _exact_bf16(x, w, b)
    # float32 sums of exact bf16 products: at most one bf16 step from the exact product rounded, almost always none
    step = torch.finfo(torch.bfloat16).eps * ref.double().abs().clamp(min=1e-3)
    assert ((y.double() - ref.double()).abs() <= step).all()
    assert (y != ref).float().mean() < 0.01


def test_other_calls_are_untouched(fp32_mode: None) -> None:
    x32, w32 = torch.randn(5, 16), torch.randn(8, 16)
    x16, w16 = x32.half(), w32.half()
    with cpu_gemm.bf16_linears_in_fp32():
        y32 = F.linear(x32, w32)
        y16 = F.linear(x16, w16)
        mixed = torch.nn.Linear(16, 8).to(torch.bfloat16)
        y_mod = mixed(x32.to(torch.bfloat16))
    assert torch.equal(y32, F.linear(x32, w32)) and y16.dtype == torch.float16
    assert torch.equal(y16, F.linear(x16, w16))
    assert y_mod.dtype == torch.bfloat16  # nn.Linear reaches F.linear, so it goes through the mode too
    assert torch.equal(
        y_mod, F.linear(x32.to(torch.bfloat16).float(), mixed.weight.float(), mixed.bias.float()).bfloat16()
    )


def test_gradients_reach_bf16_leaves(fp32_mode: None) -> None:
    x = torch.randn(4, 24).to(torch.bfloat16).requires_grad_()
    w = torch.randn(6, 24).to(torch.bfloat16).requires_grad_()
    with cpu_gemm.bf16_linears_in_fp32():
        F.linear(x, w).float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), w.double().sum(0).expand(4, 24), rtol=1e-2, atol=0)


def test_left_alone_with_a_gpu_or_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cpu_gemm.bf16_linears_in_fp32() as on:
        assert not on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: True)
    with cpu_gemm.bf16_linears_in_fp32() as on:
        assert not on
        assert F.linear is cpu_gemm._TORCH_LINEAR


@pytest.mark.parametrize(
    ("text", "native"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n", False),  # AVX2 only
        ("processor\t: 0\nflags\t\t: avx2 avx512f avx512bw\n", False),  # AVX-512 without its bf16 dot products
        ("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16\n", True),
        ("processor\t: 0\nflags\t\t: avx2 amx_bf16 amx_tile\n", True),
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm's BF16 extension
        ("processor\t: 0\nFeatures\t: fp asimd\n", False),
        ("processor\t: 0\n", True),  # no flags line: leave the default
    ],
)
def test_native_bf16_reads_the_cpu_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, native: bool
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    monkeypatch.setattr(cpu_gemm, "_CPUINFO", info)
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "x86_64")
    cpu_gemm.native_bf16.cache_clear()
    try:
        assert cpu_gemm.native_bf16() is native
        monkeypatch.setattr(cpu_gemm, "_CPUINFO", tmp_path / "missing")
        cpu_gemm.native_bf16.cache_clear()
        assert cpu_gemm.native_bf16() is True
    finally:
        cpu_gemm.native_bf16.cache_clear()
