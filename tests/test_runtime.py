"""The runtime: bf16, GPTQ and NVFP4 checkpoints loaded with packed-weight linears, against the dense loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from salaquant.calibration.calib_data import CalibOptions
from salaquant.cli import app
from salaquant.driver import run_method
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.io.reader import CheckpointReader
from salaquant.model.loading import load_model
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions
from salaquant.runtime.linear import GPTQLinear, NVFP4Linear
from salaquant.runtime.load import load

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115
SMALL = CalibOptions(max_samples=2, max_len=128)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rt")
    gptq = run_method(
        MODEL,
        root / "gptq",
        [CALIB],
        SMALL,
        GPTQMethod(BitsOptions(), GPTQLayerOptions(), RunOptions(device="cpu", show_progress=False)),
        QUIET,
    )
    nvfp4 = run_method(
        MODEL,
        root / "nvfp4",
        [CALIB],
        SMALL,
        NVFP4Method(NVFP4LayerOptions(mse_iters=4), NVFP4RunOptions(device="cpu", show_progress=False)),
        QUIET,
    )
    return {"gptq": gptq, "nvfp4": nvfp4}


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_bf16_checkpoint_equals_loader() -> None:
    ids = torch.randint(3, 4096, (1, 80), generator=torch.Generator().manual_seed(0))
    rt = load(MODEL)
    assert not any(isinstance(m, (GPTQLinear, NVFP4Linear)) for m in rt.modules())
    assert torch.equal(rt(ids).logits, load_model(MODEL)(ids).logits)


@pytest.mark.parametrize(("fmt", "cls"), [("gptq", GPTQLinear), ("nvfp4", NVFP4Linear)])
def test_quantized_checkpoint_runs_from_packed_weights(exports, fmt: str, cls: type) -> None:
    rt = load(exports[fmt], fuse=False)  # one module per exported linear (tests/test_decode.py: fused alike)
    packed = [m for m in rt.modules() if isinstance(m, cls)]
    assert len(packed) >= 40  # every quantized decoder linear runs from its packed tensors
    ids = torch.randint(3, 4096, (1, 96), generator=torch.Generator().manual_seed(1))
    dense = load_model(exports[fmt])(ids).logits  # the same weights, dequantized to bf16 by the loader
    ours = rt(ids).logits
    assert _kl(dense, ours) < 2e-3  # bf16 rounding of the dense path only
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() > 0.95
    # decode with the cache through the packed linears equals the full forward
    out = rt.greedy(ids[:, :20], 8)
    full = rt(out[:, :-1]).logits
    assert torch.equal(out[:, 20:], full[:, 19:].argmax(-1))


def test_generate_command(exports) -> None:
    res = CliRunner().invoke(
        app, ["generate", str(exports["gptq"]), "--prompt", "The king", "--max-new-tokens", "12", "--device", "cpu"]
    )
    assert res.exit_code == 0, res.output
    assert "(gptq)" in res.output and "The king" in res.output
    sampled = ["generate", str(exports["gptq"]), "--prompt", "The king", "--max-new-tokens", "12", "--device", "cpu"]
    sampled += ["--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]
    first, second = CliRunner().invoke(app, sampled), CliRunner().invoke(app, sampled)
    assert first.exit_code == 0 and second.exit_code == 0, first.output
    # the same seed, the same completion (the timing line differs)
    assert first.output.splitlines()[1:] == second.output.splitlines()[1:]
    bad = CliRunner().invoke(app, [*sampled[:8], "--top-p", "1.5"])
    assert bad.exit_code != 0 and "top_p must be in (0, 1]" in bad.output


def test_attention_kernels_route_through_dispatchers() -> None:
    """With kernels on, GLA and sparse attention go through salaquant.kernels (the reference off CUDA)."""
    ids = torch.randint(3, 4096, (1, 1100), generator=torch.Generator().manual_seed(2))  # > dense_len 1024
    plain = load(MODEL)
    routed = load(MODEL, kernels=True)
    assert routed.model.layers[1].self_attn.gla_fn is not plain.model.layers[1].self_attn.gla_fn
    assert routed.model.layers[0].self_attn.sparse_fn is not plain.model.layers[0].self_attn.sparse_fn
    assert torch.equal(routed(ids, attention_mode="sparse").logits, plain(ids, attention_mode="sparse").logits)


def test_nvfp4_w4a4_quantizes_each_linear_input_as_modelopt(exports) -> None:
    """``activations="fp4"``: every NVFP4 linear quantizes its input with the export's ``input_scale``. Reference,
    per linear on the inputs it sees in a forward pass: ModelOpt's NVFP4 quantization of that input, then the
    product with the dense loader's weight (a whole-model comparison would only measure how FP4 rounding magnifies
    the bf16 differences of the two paths)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    path = exports["nvfp4"]
    reader = CheckpointReader(path)
    rt = load(path, activations="fp4", fuse=False)  # per exported linear
    packed = {n: m for n, m in rt.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(packed) >= 40 and all(m.input_scale is not None for m in packed.values())
    dense = load_model(path)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        rt.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, a[0].detach()))
        for n in packed
    ]
    ids = torch.randint(3, 4096, (1, 96), generator=torch.Generator().manual_seed(2))
    w4a4 = rt(ids).logits
    for h in hooks:
        h.remove()
    for name, x in seen.items():
        s_in = reader.get(f"{name}.input_scale").float()
        q, scale, s2 = NVFP4QTensor.quantize(x.reshape(-1, x.shape[-1]).float(), 16, weights_scaling_factor_2=s_in)
        xq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: 16})
        want = torch.nn.functional.linear(xq.reshape(x.shape).to(x.dtype), dense.get_submodule(name).weight)
        got = packed[name](x)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert _kl(load(path)(ids).logits, w4a4) > 1e-4  # the activations really are quantized
    with pytest.raises(ValueError, match="needs an NVFP4 export"):
        load(exports["gptq"], activations="fp4")
    with pytest.raises(ValueError, match="activations must be one of"):
        load(path, activations="fp8")
