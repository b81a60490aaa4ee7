"""Programmatic dependent launch of the 4-bit matrix kernels (opt-in, ``pdl=True``): when the launch takes it, and
on a GPU that a chain of kernels, each reading the previous one's output, gives the same bits with it as without,
eagerly and captured in a CUDA graph; and that an InfLLM-v2 entry point, most of whose kernels take it, reads its input
only once the kernel that writes it has finished."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from test_kernels_infllm import SMALL as _SMALL  # the InfLLM-v2 kernel tests' small configuration
from triton.language.extra.cuda import gdc_launch_dependents

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


@triton.jit
def _late_copy(src_ptr, dst_ptr, n, spins, BLOCK: tl.constexpr):
    """Let dependent kernels start at once, then spend ``spins`` volatile loads before copying ``src`` to ``dst``."""
    gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):
        acc += tl.load(src_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, other=0.0), mask=mask & (acc == acc))


@triton.jit
def _copy_without_wait(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """A dependent kernel that breaks the rule: it reads ``src`` without waiting for the kernel before it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, other=0.0), mask=mask)


def _written_late(src: torch.Tensor, spins: int = 50_000) -> torch.Tensor:
    """A NaN tensor like ``src`` that ``_late_copy`` fills with ``src`` milliseconds after it let the next kernel
    start (queued, not waited for)."""
    dst = torch.full_like(src, float("nan"))
    n = src.numel()
    _late_copy[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024)
    return dst


def _sparse_inputs() -> tuple[torch.Tensor, ...]:
    """SALA's head layout (2 KV heads of 16 query heads, dim 128) over 512 keys, 64 queries, bf16."""
    from salaquant.model import sparse_attention as ref

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, t, h, 128, generator=gen) for t, h in ((64, 32), (512, 2), (512, 2)))
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    k1 = ref.compress_keys(k, _SMALL.kernel_size, _SMALL.kernel_stride)
    k2 = ref.compress_keys(k, _SMALL.kernel_size2, _SMALL.kernel_stride2)
    return q, k, v, k1, k2


@pytest.mark.gpu
def test_gpu_late_writer_lets_a_pdl_kernel_start_early() -> None:
    """The harness below has teeth: a kernel launched for programmatic dependent launch right behind ``_late_copy``
    and reading without ``griddepcontrol.wait`` sees the destination before it is written (NaN)."""
    if not dev.pdl_capable(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90")
    src = torch.randn(1 << 18, device="cuda")
    seen = torch.empty_like(src)
    _copy_without_wait[(256,)](src, seen, src.numel(), BLOCK=1024, launch_pdl=True)  # compiled before the test
    torch.cuda.synchronize()
    late = _written_late(src)
    _copy_without_wait[(256,)](late, seen, src.numel(), BLOCK=1024, launch_pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(late, src)
    assert torch.isnan(seen).any()


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["stage1", "select", "stage2"])
def test_gpu_infllm_waits_before_reading(step: str) -> None:
    """Each InfLLM-v2 entry point launched right behind a kernel that lets it start at once and writes its input
    milliseconds later: each of its kernels launched for programmatic dependent launch waits before it touches
    memory, and each launched the ordinary way waits by stream order, so the result equals the same call on the input
    written beforehand, bit for bit."""
    from salaquant.kernels import infllm
    from salaquant.model import sparse_attention as ref

    if not dev.pdl_capable(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90")
    p = _SMALL
    q, k, v, k1, k2 = _sparse_inputs()
    tk = k.shape[1]
    q_start = tk - q.shape[1]
    scores = ref.stage1_scores(q, k1, k2, q_start, p).contiguous()
    idx = ref.select_blocks(ref.block_scores(scores, q_start, tk, p), q_start, p).to(torch.int32)

    def call(x: torch.Tensor) -> torch.Tensor:
        if step == "stage1":  # four splits: the separate LSE kernel, then the scoring kernel behind it
            args = (p.kernel_size, p.kernel_stride, p.kernel_size2, p.kernel_stride2)
            return infllm.stage1_scores(x, k1, k2, q_start, *args, num_splits=4)
        if step == "select":
            n_sel = p.total_topk
            return infllm.pool_select(
                x, q_start, tk, p.block_size, p.kernel_stride, p.init_blocks, p.local_blocks, n_sel
            )
        return infllm.block_sparse_attention(x, k, v, idx, q_start, p.block_size, num_splits=2)

    src = scores if step == "select" else q
    expected = call(src)  # also compiles every kernel before the timed launch
    torch.cuda.synchronize()
    got = call(_written_late(src))
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
