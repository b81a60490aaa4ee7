"""Simple GLA kernels (``salaquant.kernels.gla``) against the PyTorch references in ``salaquant.model.gla``, and the
model's ``simple_gla`` dispatching to them."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
from gla_checks import assert_close_scaled as _close
from gla_checks import gla_inputs, naive_recurrent_gla

from salaquant.model import gla as ref

pytestmark = pytest.mark.random_inputs

B, H = 2, 2
G_GAMMA = torch.tensor([-0.84, -0.01])
has_fla = importlib.util.find_spec("fla") is not None


def _tk():
    """The kernel module (imported only where the kernels run)."""
    from salaquant.kernels.gla import triton_kernels

    return triton_kernels


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating-point buffers from ``torch.empty`` come filled with NaN, so unwritten entries show up."""
    empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        out = empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", nan_empty)


def _inputs(
    t: int, dk: int = 16, dv: int = 32, dtype: torch.dtype = torch.float32, device: str = "cpu", heads: int = H
) -> tuple[torch.Tensor, ...]:
    return gla_inputs(B, t, heads, dk, dv, dtype=dtype, device=device)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [1, 50, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_naive(t: int, with_state: bool, poison: None) -> None:
    q, k, v, s0 = _inputs(t)
    init = s0 if with_state else None
    scale = q.shape[-1] ** -0.5
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, scale, init)
    o, s = _tk().chunk_fwd(q, k, v, G_GAMMA, scale, init, output_final_state=True)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)
    o2, s2 = _tk().chunk_fwd(q, k, v, G_GAMMA, scale, init)
    assert s2 is None
    _close(o2, o_ref)


@pytest.mark.interpreter
def test_chunk_strided_partial_tiles(poison: None) -> None:
    # q, k, v are views into one fused projection; V=40 leaves a partial V tile, T=70 a partial chunk
    t, dk, dv = 70, 32, 40
    fused = torch.randn(B, t, H, 2 * dk + dv)
    q, k, v = fused[..., :dk], fused[..., dk : 2 * dk], fused[..., 2 * dk :]
    s0 = torch.randn(B, H, dk, dv)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.3, s0)
    o, s = _tk().chunk_fwd(q, k, v, G_GAMMA, 0.3, s0, output_final_state=True)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [70, 200])
def test_chunk_out_dtype_is_the_fp32_output_rounded_once(t: int, poison: None) -> None:
    # K=40 and V=40 leave partial tiles, views are strided; the state does not depend on the output dtype.
    # fp16 here (bf16 stores are not exact under the interpreter); the GPU test checks bf16 the same way
    out_dtype = torch.float16
    dk, dv = 40, 40
    fused = torch.randn(B, t, H, 2 * dk + dv)
    q, k, v = fused[..., :dk], fused[..., dk : 2 * dk], fused[..., 2 * dk :]
    s0 = torch.randn(B, H, dk, dv)
    o32, s32 = _tk().chunk_fwd(q, k, v, G_GAMMA, 0.2, s0, True)
    o, s = _tk().chunk_fwd(q, k, v, G_GAMMA, 0.2, s0, True, out_dtype=out_dtype)
    assert o.dtype == out_dtype and s is not None and s32 is not None
    assert torch.equal(o, o32.to(out_dtype))
    assert torch.equal(s, s32)
    o_ref, _ = naive_recurrent_gla(q, k, v, G_GAMMA, 0.2, s0)
    _close(o32, o_ref)
    # the reference and the model's dispatch honour it too
    o_r, _ = ref.simple_gla(q, k, v, G_GAMMA, 0.2, s0, out_dtype=out_dtype)
    assert o_r.dtype == out_dtype
    o_s, _ = ref.simple_gla(q, k, v, G_GAMMA, 0.2, s0, backend="triton", out_dtype=out_dtype)
    assert torch.equal(o_s, o)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [40, 130])
def test_upcast_equals_fp32_inputs(t: int, poison: None) -> None:
    """The model's Triton path computes 16-bit q, k, v in fp32 (``upcast``): exactly what their fp32 copies give
    (T=40 takes the recurrent form, which always upcasts; T=130 the chunked form, partial last chunk, strided
    views)."""
    dk, dv = 32, 40
    fused = torch.randn(B, t, H, 2 * dk + dv).half()
    q, k, v = fused[..., :dk], fused[..., dk : 2 * dk], fused[..., 2 * dk :]
    s0 = torch.randn(B, H, dk, dv)
    o32, s32 = ref.simple_gla(q.float(), k.float(), v.float(), G_GAMMA, 0.2, s0, True, backend="triton")
    o16, s16 = ref.simple_gla(q, k, v, G_GAMMA, 0.2, s0, True, backend="triton")
    assert s32 is not None and s16 is not None
    assert torch.equal(o16, o32) and torch.equal(s16, s32)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.2, s0)
    assert s_ref is not None
    _close(o16, o_ref)
    _close(s16, s_ref)
    if t >= ref.RECURRENT_MAX_LEN:  # without upcast the chunked form runs fp16 dots: not the same numbers
        o_half, _ = _tk().chunk_fwd(q, k, v, G_GAMMA, 0.2, s0, True)
        assert not torch.equal(o_half, o32)


def test_chunk_option_errors() -> None:
    q, k, v, s0 = _inputs(70)
    with pytest.raises(ValueError, match="out_dtype"):
        _tk().chunk_fwd(q, k, v, G_GAMMA, 0.2, s0, out_dtype=torch.int32)


@pytest.mark.interpreter
def test_chunk_fp16_inputs(poison: None) -> None:
    q, k, v, s0 = _inputs(130, dtype=torch.float16)
    o_ref, s_ref = naive_recurrent_gla(q.float(), k.float(), v.float(), G_GAMMA, 0.25, s0)
    o, s = _tk().chunk_fwd(q, k, v, G_GAMMA, 0.25, s0, output_final_state=True)
    assert s is not None and s_ref is not None
    assert _rel_err(o, o_ref) < 3e-3
    assert _rel_err(s, s_ref) < 3e-3


@pytest.mark.interpreter
@pytest.mark.parametrize(("t", "with_state"), [(130, True), (200, False)])
def test_chunk_every_gpu_config_at_d128(t: int, with_state: bool, poison: None) -> None:
    # The interpreter autotunes over one small tile; run each GPU autotune configuration by itself at SALA's
    # head dim (K = V = 128), on the GPU when there is one. Every state and output configuration runs once.
    tk = _tk()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tol = 5e-3 if device == "cuda" else 1e-5  # TF32 dots on a GPU
    q, k, v, s0 = (x[:1] for x in _inputs(t, dk=128, dv=128, device=device))
    g = G_GAMMA.to(device)
    init = s0 if with_state else None
    o_ref, s_ref = ref.simple_gla(q, k, v, g, 128**-0.5, init, output_final_state=True, form="chunk")
    assert s_ref is not None
    n = max(len(tk.STATE_CONFIGS), len(tk.OUTPUT_CONFIGS))
    for i in range(n):
        configs = (tk.STATE_CONFIGS[i % len(tk.STATE_CONFIGS)], tk.OUTPUT_CONFIGS[i % len(tk.OUTPUT_CONFIGS)])
        try:
            o, s = tk.chunk_fwd(q, k, v, g, 128**-0.5, init, True, configs=configs)
            assert s is not None
            errors = (_rel_err(o, o_ref), _rel_err(s, s_ref))
        except RuntimeError as exc:  # name the configuration that failed to launch or crashed
            raise AssertionError(f"configs {configs}: {exc}") from exc
        assert max(errors) < tol, (configs, errors)


def test_tuned_configs_are_autotune_candidates() -> None:
    """A pinned case must launch a configuration the sweep above checks against the reference."""
    tk = _tk()
    assert tk.TUNED_CONFIGS
    for (major, dk, dv, dtype, out_dtype), (state, output) in tk.TUNED_CONFIGS.items():
        assert major >= 7 and dk > 0 and dv > 0
        assert dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert out_dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert state in tk.STATE_CONFIGS and output in tk.OUTPUT_CONFIGS
    # the model's case is pinned for both output dtypes it uses (no autotuning inside a quantization run)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert (9, 128, 128, torch.float32, out_dtype) in tk.TUNED_CONFIGS
    # no pin off the GPU: the interpreter and the CPU keep their own path
    assert tk._tuned(torch.device("cpu"), 128, 128, torch.float32, torch.float32) is None


@pytest.mark.interpreter
def test_chunk_tiles_fit_head_dims(poison: None) -> None:
    import triton

    tk = _tk()
    candidates = [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for bk, bv, w, s in tk.STATE_CONFIGS]
    assert len(tk._prune_configs(candidates, {}, K=128, V=128)) == len(candidates)
    pruned = tk._prune_configs(candidates, {}, K=16, V=40)
    tiles = [(c.kwargs["BK"], c.kwargs["BV"], c.num_warps, c.num_stages) for c in pruned]
    assert len(set(tiles)) == len(tiles) < len(candidates)
    assert all(bk == 16 and bv in (32, 64) for bk, bv, _, _ in tiles)
    # the largest GPU tiles, pinned, on a head dim they overhang (K=16) and a partial V tile (V=40)
    q, k, v, s0 = _inputs(70, dk=16, dv=40)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.25, s0)
    o, s = tk.chunk_fwd(q, k, v, G_GAMMA, 0.25, s0, True, configs=((128, 32, 8, 3), (128, 128, 8, 2)))
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_naive(t: int, with_state: bool, poison: None) -> None:
    q, k, v, s0 = _inputs(t, dk=32, dv=32)
    init = s0 if with_state else None
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.2, init)
    o, s = _tk().recurrent_fwd(q, k, v, G_GAMMA, 0.2, init, output_final_state=True)
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)
    o2, s2 = _tk().recurrent_fwd(q, k, v, G_GAMMA, 0.2, init)
    assert s2 is None
    _close(o2, o_ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [1, 3])
def test_recurrent_updates_the_state_in_place(t: int, poison: None) -> None:
    """``state_out=initial_state``: the buffer ends as the reference's final state, the output is unchanged; the
    compiler's custom op (``kernels.ops.gla_recurrent_op``) does the same and passes PyTorch's own op checks
    (declared mutation, fake tensor)."""
    from salaquant.kernels.ops import gla_recurrent_op

    q, k, v, s0 = _inputs(t, dk=32, dv=32)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.2, s0)
    assert s_ref is not None
    buf = s0.clone()
    o, s = _tk().recurrent_fwd(q, k, v, G_GAMMA, 0.2, buf, state_out=buf)
    assert s is buf
    _close(o, o_ref)
    _close(buf, s_ref)
    buf = s0.clone()
    _close(gla_recurrent_op(q, k, v, G_GAMMA, 0.2, buf), o_ref)
    _close(buf, s_ref)
    torch.library.opcheck(gla_recurrent_op, (q, k, v, G_GAMMA, 0.2, s0.clone()))
    with pytest.raises(ValueError, match="state_out must be contiguous fp32"):
        _tk().recurrent_fwd(q, k, v, G_GAMMA, 0.2, s0, state_out=s0.transpose(-1, -2))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("t", [2, 70])
def test_simple_gla_in_place(backend: str, t: int) -> None:
    """``simple_gla(..., in_place=True)`` returns ``initial_state`` itself holding the final state, with the output
    of the call that returns a new state; without an initial state it refuses."""
    q, k, v, s0 = _inputs(t)
    o_ref, s_ref = ref.simple_gla(q, k, v, G_GAMMA, 0.25, s0, True, backend=backend)
    buf = s0.clone()
    o, s = ref.simple_gla(q, k, v, G_GAMMA, 0.25, buf, backend=backend, in_place=True)
    assert s is buf and s_ref is not None
    _close(o, o_ref)
    _close(buf, s_ref)
    with pytest.raises(ValueError, match="in_place updates initial_state"):
        ref.simple_gla(q, k, v, G_GAMMA, 0.25, backend=backend, in_place=True)


@pytest.mark.interpreter
def test_closed_form_geometric_series() -> None:
    # q = k = e_0, v = e_0: S_t[0, 0] = exp(g (t+1)) s0 + sum_{j<=t} exp(g (t-j)), o_t[0] = scale * S_t[0, 0]
    t, dk, dv, s00 = 130, 16, 16, 2.0
    q = torch.zeros(B, t, H, dk)
    q[..., 0] = 1.0
    v = torch.zeros(B, t, H, dv)
    v[..., 0] = 1.0
    s0 = torch.zeros(B, H, dk, dv)
    s0[..., 0, 0] = s00
    steps = torch.arange(1, t + 1, dtype=torch.float64)
    expected = torch.empty(t, H, dtype=torch.float64)
    for h, g in enumerate(G_GAMMA.double().tolist()):
        expected[:, h] = math.exp(g) ** steps * s00 + (1 - torch.exp(g * steps)) / (1 - math.exp(g))
    for fn, length in ((_tk().chunk_fwd, t), (_tk().recurrent_fwd, 3)):
        o, s = fn(q[:, :length], q[:, :length], v[:, :length], G_GAMMA, 0.5, s0, True)
        assert s is not None
        want = (0.5 * expected[:length]).float().expand(B, length, H)
        torch.testing.assert_close(o[..., 0], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[..., 0, 0], expected[length - 1].float().expand(B, H), rtol=1e-5, atol=1e-5)
        assert o[..., 1:].abs().max() == 0


@pytest.mark.interpreter
@pytest.mark.parametrize(("t", "used"), [(63, "recurrent_fwd"), (64, "chunk_fwd")])
def test_simple_gla_dispatch(t: int, used: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from salaquant.kernels import gla

    calls: list[str] = []
    for name in ("recurrent_fwd", "chunk_fwd"):
        fn = getattr(gla, name)
        monkeypatch.setattr(gla, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))
    q, k, v, s0 = _inputs(t)
    o_ref, s_ref = naive_recurrent_gla(q, k, v, G_GAMMA, 0.25, s0)
    o, s = ref.simple_gla(q, k, v, G_GAMMA, 0.25, s0, output_final_state=True, backend="triton")
    assert calls == [used]
    assert s is not None and s_ref is not None
    _close(o, o_ref)
    _close(s, s_ref)


def test_auto_on_cpu_is_reference() -> None:
    for t in (40, 70):
        q, k, v, s0 = _inputs(t)
        o, s = ref.simple_gla(q, k, v, G_GAMMA, 0.25, s0, True, backend="auto")
        o_ref, s_ref = ref.simple_gla(q, k, v, G_GAMMA, 0.25, s0, True)
        assert s is not None and s_ref is not None
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="backend must be one of"):
        ref.simple_gla(q, k, v, G_GAMMA, 0.25, backend="cuda")


def test_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from salaquant.model.gla import simple_gla\n"
        "q = torch.randn(1, 3, 2, 8)\n"
        "o, s = simple_gla(q, q, q, torch.tensor([-0.5, -0.1]), 0.3, None, True, backend='auto')\n"
        "assert o.shape == (1, 3, 2, 8) and s.shape == (1, 2, 8, 8)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _sala_inputs(t: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    heads, d = 32, 128
    q, k, v, s0 = gla_inputs(batch, t, heads, d, d, dtype=dtype, device="cuda")
    g = -ref.alibi_slopes(heads).cuda()
    return q, k, v, s0, g


@pytest.mark.gpu
def test_gpu_chunk_bf16_every_output_config() -> None:
    """bf16 inputs with fp32 and bf16 outputs through every output-kernel candidate (the autotuner may pick any
    of them; one tile miscompiled for a bf16 output once)."""
    tk = _tk()
    q, k, v, s0, g = _sala_inputs(8192, 1, torch.bfloat16)
    scale = 128**-0.5
    o_ref, s_ref = ref.simple_gla(q, k, v, g, scale, s0, output_final_state=True, form="chunk")
    assert s_ref is not None
    for config in tk.OUTPUT_CONFIGS:
        pinned = (tk.STATE_CONFIGS[0], config)
        o32, s = tk.chunk_fwd(q, k, v, g, scale, s0, True, configs=pinned)
        o16, _ = tk.chunk_fwd(q, k, v, g, scale, s0, True, configs=pinned, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16 and s is not None
        assert _rel_err(o32, o_ref) < 2e-2, config
        assert _rel_err(s, s_ref) < 2e-2, config
        assert torch.equal(o16, o32.to(torch.bfloat16)), config  # the fp32 result rounded once


@pytest.mark.gpu
def test_gpu_chunk_sala_shape() -> None:
    tk = _tk()
    q, k, v, s0, g = _sala_inputs(4096, 1, torch.float32)
    scale = 128**-0.5
    o_ref, s_ref = ref.simple_gla(q, k, v, g, scale, s0, output_final_state=True, form="chunk")
    assert s_ref is not None
    o, s = tk.chunk_fwd(q, k, v, g, scale, s0, True)  # TF32 dots
    assert s is not None
    assert _rel_err(o, o_ref) < 5e-3 and _rel_err(s, s_ref) < 5e-3
    # the model's case: fp32 operands, TF32 dots, the output stored as bf16 = the fp32 output rounded once
    o16, s16 = tk.chunk_fwd(q, k, v, g, scale, s0, True, out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and s16 is not None
    assert torch.equal(o16, o.to(torch.bfloat16)) and torch.equal(s16, s)
    # and as the runtime runs it: bf16 activations upcast in the kernel = their fp32 copies, up to the order of fp32
    # operations the compiler picks for each (on an H200: relative 5e-6 on o, 1e-7 on the state), far below the
    # TF32 error of either against the reference (5e-3 above)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o_up, s_up = tk.chunk_fwd(qb, kb, vb, g, scale, s0, True, upcast=True)
    o_cp, s_cp = tk.chunk_fwd(qb.float(), kb.float(), vb.float(), g, scale, s0, True)
    assert s_up is not None and s_cp is not None
    assert _rel_err(o_up, o_cp) < 1e-4 and _rel_err(s_up, s_cp) < 1e-5
    # bf16 inputs against the reference on the same rounded values
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o_ref_b, s_ref_b = ref.simple_gla(qb, kb, vb, g, scale, s0, output_final_state=True, form="chunk")
    o, s = tk.chunk_fwd(qb, kb, vb, g, scale, s0, True)
    assert s is not None and s_ref_b is not None
    assert _rel_err(o, o_ref_b) < 2e-2
    assert _rel_err(s, s_ref_b) < 2e-2
    if has_fla:
        from fla.ops.simple_gla import chunk_simple_gla

        o_fla, s_fla = chunk_simple_gla(q, k, v, g_gamma=g, scale=scale, initial_state=s0, output_final_state=True)
        o, s = tk.chunk_fwd(q, k, v, g, scale, s0, True)
        assert s is not None
        assert _rel_err(o, o_fla) < 5e-3
        assert _rel_err(s, s_fla) < 5e-3


@pytest.mark.gpu
def test_gpu_recurrent_decode() -> None:
    q, k, v, s0, g = _sala_inputs(1, 8, torch.float32)
    scale = 128**-0.5
    o_ref, s_ref = ref.simple_gla(q, k, v, g, scale, s0, output_final_state=True, form="recurrent")
    assert s_ref is not None
    o, s = ref.simple_gla(q, k, v, g, scale, s0, True, backend="auto")
    assert s is not None
    assert _rel_err(o, o_ref) < 1e-5 and _rel_err(s, s_ref) < 1e-5
    q5, k5, v5, _, _ = _sala_inputs(37, 8, torch.float32)
    o_ref, s_ref = ref.simple_gla(q5, k5, v5, g, scale, s0, output_final_state=True, form="recurrent")
    o, s = ref.simple_gla(q5, k5, v5, g, scale, s0, True, backend="auto")
    assert s is not None and s_ref is not None
    assert _rel_err(o, o_ref) < 1e-5 and _rel_err(s, s_ref) < 1e-5
    if has_fla:
        from fla.ops.simple_gla import fused_recurrent_simple_gla

        o_fla, s_fla = fused_recurrent_simple_gla(
            q, k, v, g_gamma=g, scale=scale, initial_state=s0, output_final_state=True
        )
        o, s = _tk().recurrent_fwd(q, k, v, g, scale, s0, True)
        assert s is not None
        assert _rel_err(o, o_fla) < 1e-5
        assert _rel_err(s, s_fla) < 1e-5
