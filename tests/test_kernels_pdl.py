"""Programmatic dependent launch of the 4-bit matrix kernels (opt-in, ``pdl=True``): when the launch takes it, and
on a GPU that a chain of kernels, each reading the previous one's output, gives the same bits with it as without,
eagerly and captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from salaquant.kernels import device as dev

pytestmark = pytest.mark.random_inputs


def _pdl_kernels() -> list[str]:
    """Every Triton kernel of salaquant.kernels that declares the ``PDL`` constexpr."""
    import importlib
    import pkgutil

    import triton

    import salaquant.kernels as kernels

    found = []
    for info in pkgutil.walk_packages(kernels.__path__, "salaquant.kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.KernelInterface) and "PDL" in getattr(obj, "arg_names", ()):
                found.append(f"{info.name}.{name}")
    return found


def test_pdl_options_are_what_triton_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a capable GPU the launch options name a field of Triton's own NVIDIA launch options (the flag its
    launcher hands to cuLaunchKernelEx; a misspelt one would be dropped or refused) plus the ``PDL`` constexpr
    that salaquant's PDL kernels declare; before compute capability 9, or when not asked, only ``PDL=False``."""
    from dataclasses import fields

    from triton.backends.nvidia.compiler import CUDAOptions

    kernels = _pdl_kernels()  # imported before the patch: modules read the flag when they load
    monkeypatch.setattr(dev, "INTERPRET", False)
    for capability, asked, on in ((9, True, True), (10, True, True), (8, True, False), (9, False, False)):
        monkeypatch.setattr(dev, "cuda_facts", lambda device, c=capability: (132, c))
        got = dev.pdl_launch(torch.device("cuda"), asked)
        if on:
            assert got.pop("PDL") is True and got and set(got) <= {f.name for f in fields(CUDAOptions)}
            assert all(v is True for v in got.values())
        else:
            assert got == {"PDL": False}
    assert len(kernels) >= 10  # the InfLLM-v2 and 4-bit matrix kernels


def test_no_pdl_on_cpu() -> None:
    assert not dev.pdl_capable(torch.device("cpu"))
    assert dev.pdl_launch(torch.device("cpu"), True) == {"PDL": False}


def _gptq(gen: torch.Generator, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(k // 128, n, generator=gen) * 0.004 + 0.001).half()
    return qweight.cuda(), scales.cuda()


def _nvfp4(gen: torch.Generator, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(0x20, 0x38, (n, k // 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    return weight.cuda(), scale.view(torch.float8_e4m3fn).cuda(), torch.tensor(0.01, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "m"), [("gptq", 1), ("gptq", 4), ("gptq", 12), ("nvfp4", 1), ("nvfp4", 2)])
def test_gpu_pdl_chain(fmt: str, m: int) -> None:
    """Three square layers, each fed the previous output: with PDL, eagerly and replayed from a CUDA graph, the
    same bits as without."""
    from salaquant.kernels.nvfp4 import triton_kernels as nk
    from salaquant.kernels.nvfp4 import tuning
    from salaquant.kernels.w4a16 import triton_kernels as wk

    if not dev.pdl_capable(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90")
    k = 4096
    gen = torch.Generator().manual_seed(m)
    if fmt == "gptq":
        layers = [_gptq(gen, k, k) for _ in range(3)]

        def layer(x: torch.Tensor, w: tuple, pdl: bool) -> torch.Tensor:
            if m == 1:
                return wk.matmul_paired(x, *w, 4, 128, pdl=pdl)
            return wk.matmul_mma_rows(x, *w, 4, 128, pdl=pdl)
    else:
        layers = [_nvfp4(gen, k, k) for _ in range(3)]

        def layer(x: torch.Tensor, w: tuple, pdl: bool) -> torch.Tensor:
            rows = nk.NVFP4Config("rows", block_n=128, split_k=tuning._rows_split(k, k, 128, x.device), num_stages=1)
            return nk.nvfp4_matmul_triton(x, *w, pdl=pdl, config=rows if m > 1 else None)

    def chain(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        for w in layers:
            x = layer(x, w, pdl)
        return x

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(chain(x, True), chain(x, False))  # also compiles both builds before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x, True)
    for _ in range(3):
        x.copy_(torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16))
        expect = chain(x, False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(expect.float()).all()
        assert torch.equal(y, expect)
