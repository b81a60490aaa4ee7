"""No Triton kernel of the calibration and runtime paths reads memory that nothing wrote: run under the interpreter with
every ``torch.empty`` (and ``empty_like``, ``Tensor.new_empty``) filled with NaN (integers with -7, booleans with
True) first, each family returns the same bits as with the allocator's contents. A kernel that read an output or a
workspace before writing it would carry the NaN, or the -7, into its result; on a GPU that read sees whatever the
allocator's block last held, and the bytes would depend on the run's history."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from test_kernels_infllm import SMALL as _SMALL  # the InfLLM-v2 kernel tests' small configuration

from salaquant.model import sparse_attention as ref

pytestmark = pytest.mark.interpreter


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)


@contextmanager
def _poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **k: _fill(empty(*a, **k)))
        m.setattr(torch, "empty_like", lambda *a, **k: _fill(empty_like(*a, **k)))
        m.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _fill(new_empty(self, *a, **k)))
        yield


def _outputs(result: object) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if t is not None]


def _cases() -> dict[str, Callable[[], object]]:
    from salaquant.gptq.solver import GPTQConfig, gptq
    from salaquant.kernels import infllm
    from salaquant.kernels.gla.triton_kernels import chunk_fwd
    from salaquant.kernels.rmsnorm.triton_kernels import rms_norm_triton

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 100, 2, 32, generator=g) * 0.5 for _ in range(3))  # a partial last chunk of 64
    gamma, h0 = -torch.rand(2, generator=g), torch.randn(1, 2, 32, 32, generator=g)
    x, w = torch.randn(5, 70, generator=g), torch.randn(70, generator=g)
    p = _SMALL
    tq, tk = 40, 200
    sq = torch.randn(1, tq, 4, 16, generator=g)
    sk, sv = (torch.randn(1, tk, 2, 16, generator=g) for _ in range(2))
    k1 = ref.compress_keys(sk, p.kernel_size, p.kernel_stride)
    k2 = ref.compress_keys(sk, p.kernel_size2, p.kernel_stride2)
    q_start = tk - tq
    scores = ref.stage1_scores(sq, k1, k2, q_start, p)
    idx = ref.select_blocks(ref.block_scores(scores, q_start, tk, p), q_start, p).to(torch.int32)
    hw, hx = torch.randn(48, 256, generator=g), torch.randn(512, 256, generator=g)
    kernel_sizes = (p.kernel_size, p.kernel_stride, p.kernel_size2, p.kernel_stride2)
    select = (p.block_size, p.kernel_stride, p.init_blocks, p.local_blocks, p.total_topk)
    return {
        "gla": lambda: chunk_fwd(q, k, v, gamma, 0.2, h0, True),
        "gla_fp16_upcast": lambda: chunk_fwd(
            q.half(), k.half(), v.half(), gamma, 0.2, None, True, upcast=True, out_dtype=torch.float16
        ),
        "rmsnorm": lambda: rms_norm_triton(x, w, 1e-6),
        "stage1": lambda: infllm.stage1_scores(sq, k1, k2, q_start, *kernel_sizes),
        "stage1_splits": lambda: infllm.stage1_scores(sq, k1, k2, q_start, *kernel_sizes, num_splits=3),
        "select": lambda: infllm.pool_select(scores, q_start, tk, *select),
        "stage2": lambda: infllm.block_sparse_attention(sq, sk, sv, idx, q_start, p.block_size),
        "stage2_splits": lambda: infllm.block_sparse_attention(sq, sk, sv, idx, q_start, p.block_size, num_splits=2),
        "gptq_mse": lambda: (lambda r: (r.weight.codes, r.weight.scales))(
            gptq(hw, hx.T @ hx, GPTQConfig(bits=4, group_size=128, backend="triton", mse=True))
        ),
    }


@pytest.mark.parametrize(
    "name",
    ["gla", "gla_fp16_upcast", "rmsnorm", "stage1", "stage1_splits", "select", "stage2", "stage2_splits", "gptq_mse"],
)
def test_same_bits_with_poisoned_allocations(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    call = _cases()[name]
    plain = _outputs(call())
    with _poisoned(monkeypatch):
        poisoned = _outputs(call())
    assert plain and len(plain) == len(poisoned)
    for a, b in zip(plain, poisoned, strict=True):
        assert not (a.is_floating_point() and torch.isnan(a).any())
        assert torch.equal(a, b), name


def test_a_kernel_that_skips_its_output_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: the kernel wrappers' own allocations get the poison, so RMSNorm with its kernel launch
    made a no-op (its output never written) returns NaN where the plain allocation may hold anything."""
    from salaquant.kernels.rmsnorm import triton_kernels

    class _Skipped:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: None

    x, w = torch.randn(5, 70), torch.randn(70)
    monkeypatch.setattr(triton_kernels, "_rms_norm_kernel", _Skipped())
    with _poisoned(monkeypatch):
        assert torch.isnan(triton_kernels.rms_norm_triton(x, w, 1e-6)).all()
