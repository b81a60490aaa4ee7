"""Launch-configuration sweep of the GLA chunked-prefill kernels at SALA's shape (B=1, H=32, D=128), against fla's
own two kernels (``chunk_fwd_h`` and ``chunk_fwd_o``) timed one by one in the same run.

For each case (bf16 inputs and output as fla; bf16 inputs upcast to fp32 with TF32 dots, bf16 output, as the
runtime) every state-kernel configuration is timed with the tuned output configuration, then every output
configuration with the best state one. Also reports how far upcast results are from fp32 copies' results.

  python benchmarks/gla_configs.py --out OUT [--t 32768]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton.testing
from salaquant.kernels.gla import triton_kernels as tk

from salaquant.model import gla as ref

H, D = 32, 128
SCALE = D**-0.5
STATE_SPACE = [
    (bk, bv, w, s) for bk, bv in itertools.product((32, 64, 128), (32, 64)) for w in (2, 4, 8) for s in (2, 3, 4)
]
OUTPUT_SPACE = [
    (bk, bv, w, s) for bk, bv in ((64, 64), (128, 64), (64, 128), (128, 128), (32, 64)) for w in (4, 8) for s in (2, 3)
]


def _bench(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _try(fn: Callable[[], object]) -> float | None:
    try:
        return _bench(fn)
    except Exception as exc:  # a configuration that does not compile or fit is skipped
        print(f"  failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None


SUMMARY = ("tuned_ms", "best_state", "best_state_ms", "best_output", "best_ms")


def sweep(q, k, v, g, upcast: bool, tuned: tuple, narrow: bool = False) -> dict:
    prec = "tf32"

    def run(cfg: tuple) -> Callable[[], object]:
        return lambda: tk.chunk_fwd(
            q, k, v, g, SCALE, None, True, prec, configs=cfg, out_dtype=torch.bfloat16, upcast=upcast
        )

    tuned_ms = _try(run(tuned))
    state = {}
    for c in STATE_SPACE:
        if narrow and (c[2] == 2 or c[3] == 4):
            continue
        state[str(c)] = _try(run((c, tuned[1])))
    ok = {k: t for k, t in state.items() if t is not None}
    best_state = min(ok, key=ok.get)
    bs = tuple(json.loads(best_state.replace("(", "[").replace(")", "]")))
    output = {}
    for c in OUTPUT_SPACE:
        output[str(c)] = _try(run((bs, c)))
    ok_o = {k: t for k, t in output.items() if t is not None}
    best_output = min(ok_o, key=ok_o.get)
    return {
        "tuned": [list(tuned[0]), list(tuned[1])],
        "tuned_ms": tuned_ms,
        "best_state": best_state,
        "best_state_ms": ok[best_state],
        "best_output": best_output,
        "best_ms": ok_o[best_output],
        "state_sweep_ms": state,
        "output_sweep_ms": output,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--t", type=int, default=32768)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.t, H, D, device="cuda").bfloat16() for _ in range(3))
    g = -ref.alibi_slopes(H).cuda()
    res: dict = {"t": args.t}

    # upcast against fp32 copies, same configurations
    cfg = tk.TUNED_CONFIGS[(9, 128, 128, "tf32", torch.float32, torch.bfloat16)]
    o_up, s_up = tk.chunk_fwd(q, k, v, g, SCALE, None, True, configs=cfg, out_dtype=torch.bfloat16, upcast=True)
    o_cp, s_cp = tk.chunk_fwd(
        q.float(), k.float(), v.float(), g, SCALE, None, True, configs=cfg, out_dtype=torch.bfloat16
    )
    o32_up, _ = tk.chunk_fwd(q, k, v, g, SCALE, None, False, configs=cfg, upcast=True)
    o32_cp, _ = tk.chunk_fwd(q.float(), k.float(), v.float(), g, SCALE, None, False, configs=cfg)
    ro, rs = ref.chunk_gla(q.float(), k.float(), v.float(), g, SCALE, None, True)
    assert s_up is not None and s_cp is not None and rs is not None
    res["upcast_vs_copies"] = {
        "state_equal": bool(torch.equal(s_up, s_cp)),
        "state_rel": _rel(s_up, s_cp),
        "state_max_abs": float((s_up - s_cp).abs().max()),
        "o_bf16_equal": bool(torch.equal(o_up, o_cp)),
        "o_bf16_mismatched_fraction": float((o_up != o_cp).float().mean()),
        "o_fp32_rel": _rel(o32_up, o32_cp),
        "o_fp32_max_abs": float((o32_up - o32_cp).abs().max()),
        "state_rel_vs_ref": [_rel(s_up, rs), _rel(s_cp, rs)],
        "o_fp32_rel_vs_ref": [_rel(o32_up, ro), _rel(o32_cp, ro)],
    }
    print(json.dumps(res["upcast_vs_copies"]), flush=True)
    del o_up, o_cp, o32_up, o32_cp, ro, rs

    if importlib.util.find_spec("fla") is not None:
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.simple_gla import chunk_simple_gla

        gl = g / 0.6931471805599453  # fla's kernels take the decay in log2 units
        h, _ = chunk_fwd_h(k=k, v=v, g_gamma=gl, output_final_state=True)
        res["fla_ms"] = {
            "total": _bench(lambda: chunk_simple_gla(q, k, v, g_gamma=g, scale=SCALE, output_final_state=True)),
            "chunk_fwd_h": _bench(lambda: chunk_fwd_h(k=k, v=v, g_gamma=gl, output_final_state=True)),
            "chunk_fwd_o": _bench(lambda: chunk_fwd_o(q=q, k=k, v=v, g_gamma=gl, h=h, scale=SCALE)),
        }
        print(json.dumps(res["fla_ms"]), flush=True)

    res["bf16"] = sweep(q, k, v, g, False, tk.TUNED_CONFIGS[(9, 128, 128, "tf32", torch.bfloat16, torch.bfloat16)])
    print("bf16", {key: res["bf16"][key] for key in SUMMARY}, flush=True)
    (args.out / "gla_configs.json").write_text(json.dumps(res, indent=1))
    res["upcast"] = sweep(q, k, v, g, True, cfg, narrow=True)
    print("upcast", {key: res["upcast"][key] for key in SUMMARY}, flush=True)
    (args.out / "gla_configs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
