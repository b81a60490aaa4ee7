"""Simple GLA kernels against fla: chunked prefill and recurrent decode at SALA's shape (H=32, D=128).

Prefill: B=1, T in {8192, 32768, 131072}, no initial state, final state out, bf16 and fp32 inputs (TF32 dots for
fp32), each with an fp32 and a bf16 output (fla returns the input dtype; the model takes bf16), and bf16 inputs
computed in fp32 (``upcast``, the runtime's case). Decode: T=1, B in {1, 8, 64}, fp32 inputs and states. fla
(``chunk_simple_gla`` / ``fused_recurrent_simple_gla``) is timed when importable. ``speedup`` = fla time / our
time.

  python benchmarks/kernels_gla.py --out OUT [--prefill-t 8192,32768,131072 --decode-b 1,8,64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

from salaquant.kernels.gla import triton_kernels as gla_kernels
from salaquant.model import gla as ref

H, D = 32, 128
SCALE = D**-0.5
REFERENCE_MAX_T = 32768


def _bench(fn: Callable[[], object]) -> float:
    fn()  # autotune and compile outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _timed(row: dict, key: str, fn: Callable[[], object]) -> None:
    try:
        row[key] = _bench(fn)
    except Exception as exc:  # a config that fails to compile is recorded, the rest still run
        row[key] = None
        row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:500]


def _errors(row: dict, o: torch.Tensor, s: torch.Tensor, against: list[tuple[str, tuple | None]]) -> None:
    """``rel_err_o_vs_NAME`` and ``rel_err_state_vs_NAME`` of our output ``o`` and final state ``s`` against each
    ``(NAME, (output, state))`` of ``against`` that ran (None: not run), in that order."""
    for name, theirs in against:
        if theirs is not None:
            row[f"rel_err_o_vs_{name}"] = _rel(o, theirs[0])
            row[f"rel_err_state_vs_{name}"] = _rel(s, theirs[1])


def _speedup(row: dict, fla_ms: float | None) -> None:
    """``speedup`` = fla's time / ours, where both were timed."""
    if fla_ms is not None and row["ours_ms"]:
        row["speedup"] = fla_ms / row["ours_ms"]


def _prefill_bytes(q: torch.Tensor, out_bytes: int) -> int:
    """Fewest bytes of our two kernels: k, v read by both, q by the output kernel, the stored states (one per
    chunk of 64) written and read once, o written."""
    b, t, h, d = q.shape
    n_states = -(-t // 64)
    state_bytes = 2 if q.dtype == torch.bfloat16 else 4
    return 5 * q.numel() * q.element_size() + 2 * b * h * n_states * d * d * state_bytes + q.numel() * out_bytes


def prefill(ts: list[int], fla_chunk: Callable | None) -> list[dict]:
    rows = []
    g = -ref.alibi_slopes(H).cuda()
    for t in ts:
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, t, H, D, device="cuda").to(dtype) for _ in range(3))
            fla_out = None
            fla_ms = None
            if fla_chunk is not None:
                print(f"prefill T={t} {dtype}: fla", file=sys.stderr, flush=True)
                fla_out = fla_chunk(q, k, v, g_gamma=g, scale=SCALE, output_final_state=True)
                fla_ms = _bench(
                    lambda q=q, k=k, v=v: fla_chunk(q, k, v, g_gamma=g, scale=SCALE, output_final_state=True)
                )
            ref_out = ref.simple_gla(q, k, v, g, SCALE, None, True, form="chunk") if t <= REFERENCE_MAX_T else None
            # fp32 and bf16 outputs: fla returns the input dtype (a like-for-like time for bf16 inputs); the model
            # computes in fp32 and takes a bf16 output: the runtime passes bf16 activations with upcast (read as
            # bf16, computed in fp32 with TF32 dots), the same numbers as the fp32 inputs' rows
            variants = [(od, False) for od in (torch.float32, torch.bfloat16)]
            if dtype == torch.bfloat16:
                variants.append((torch.bfloat16, True))
            for out_dtype, upcast in variants:
                case = f"prefill T={t} {dtype}: out={out_dtype} upcast={upcast}"
                print(case, file=sys.stderr, flush=True)
                row: dict = {
                    "kernel": "chunk",
                    "B": 1,
                    "T": t,
                    "dtype": str(dtype).removeprefix("torch."),
                    "precision": "tf32" if dtype == torch.float32 or upcast else "-",  # the dots on fp32 operands
                    "upcast": upcast,
                    "out_dtype": str(out_dtype).removeprefix("torch."),
                    "fla_ms": fla_ms,
                }

                def ours(q=q, k=k, v=v, out_dtype=out_dtype, upcast=upcast) -> object:
                    return gla_kernels.chunk_fwd(q, k, v, g, SCALE, None, True, out_dtype=out_dtype, upcast=upcast)

                _timed(row, "ours_ms", ours)
                if row["ours_ms"] is not None:
                    _errors(row, *ours(), [("fla", fla_out), ("ref", ref_out)])
                _speedup(row, fla_ms)
                out_bytes = torch.empty(0, dtype=out_dtype).element_size()
                row["ours_tb_s"] = _prefill_bytes(q, out_bytes) / row["ours_ms"] / 1e9 if row["ours_ms"] else None
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)  # a row that fails is seen even if the run dies
            del q, k, v, fla_out, ref_out
            torch.cuda.empty_cache()
    return rows


def _decode_rows(b: int, g: torch.Tensor, fla_rec: Callable | None) -> list[dict]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, 1, H, D, device="cuda") for _ in range(3))
    s0 = torch.randn(b, H, D, D, device="cuda")
    state_bytes = 2 * s0.numel() * 4
    fla_ms = None
    fla_out = None
    if fla_rec is not None:
        fla_out = fla_rec(q, k, v, g_gamma=g, scale=SCALE, initial_state=s0, output_final_state=True)
        fla_ms = _bench(lambda: fla_rec(q, k, v, g_gamma=g, scale=SCALE, initial_state=s0, output_final_state=True))
    ref_out = ref.simple_gla(q, k, v, g, SCALE, s0, True, form="recurrent")

    def ours() -> tuple:
        return gla_kernels.recurrent_fwd(q, k, v, g, SCALE, s0, True)

    row: dict = {"kernel": "recurrent", "B": b, "T": 1, "dtype": "float32", "mode": "new_state", "fla_ms": fla_ms}
    _timed(row, "ours_ms", ours)
    if row["ours_ms"] is not None:
        _errors(row, *ours(), [("ref", ref_out), ("fla", fla_out)])
    _speedup(row, fla_ms)
    # fp32 state read and written
    row["ours_tb_s"] = state_bytes / row["ours_ms"] / 1e9 if row["ours_ms"] else None
    return [row]


def decode(bs: list[int], fla_rec: Callable | None) -> list[dict]:
    g = -ref.alibi_slopes(H).cuda()
    return [row for b in bs for row in _decode_rows(b, g, fla_rec)]


def _fmt(x: object, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (
        "| kernel | B | T | dtype | precision/mode | out | ours ms | fla ms | speedup | ours TB/s "
        "| rel err o (fla / ref) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        err = f"{_fmt(r.get('rel_err_o_vs_fla'), '.1e')} / {_fmt(r.get('rel_err_o_vs_ref'), '.1e')}"
        lines.append(
            f"| {r['kernel']} | {r['B']} | {r['T']} | {r['dtype']} | {r.get('precision', r.get('mode'))} "
            f"| {r.get('out_dtype', 'float32')} "
            f"| {_fmt(r['ours_ms'], '.4f')} | {_fmt(r['fla_ms'], '.4f')} | {_fmt(r.get('speedup'), '.2f')} "
            f"| {_fmt(r.get('ours_tb_s'), '.2f')} | {err} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prefill-t", default="8192,32768,131072")
    ap.add_argument("--decode-b", default="1,8,64")
    ap.add_argument("--no-fla", action="store_true", help="time our kernels only, even where fla is importable")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    fla_chunk = fla_rec = None
    if not args.no_fla and importlib.util.find_spec("fla") is not None:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

        fla_chunk, fla_rec = chunk_simple_gla, fused_recurrent_simple_gla
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": None,
    }
    if fla_chunk is not None:
        import fla

        res["fla"] = getattr(fla, "__version__", "unknown")
    rows = prefill([int(x) for x in args.prefill_t.split(",") if x], fla_chunk)
    rows += decode([int(x) for x in args.decode_b.split(",") if x], fla_rec)
    res["rows"] = rows
    # the autotuner's choice per key (K, V, precision, dtypes): what a pinned default would have to match
    res["autotuned"] = {
        name: {str(key): str(cfg) for key, cfg in getattr(kernel, "cache", {}).items()}
        for name, kernel in (("state", gla_kernels._chunk_state_kernel), ("output", gla_kernels._chunk_output_kernel))
    }
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels_gla.json").write_text(json.dumps(res, indent=2))
    (args.out / "kernels_gla.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
