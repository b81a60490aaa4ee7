"""Quality of salaquant's quantizers against the tools users would otherwise pick, on a shipped model.

Same model (``models/sala-tiny``, or ``--model``, e.g. ``models/sala-small``), same calibration token sequences
(the shipped set through ``salaquant.calibration.calib_data``), same held-out windows (the shipped sample, dense
attention, CPU), one table: perplexity increase over bf16, KL(bf16 || quantized) per token and top-1 agreement for

* RTN W4 g128 symmetric (the baseline), salaquant GPTQ W4A16 with and without SmoothQuant (and with MSE scales);
* salaquant NVFP4 default exclusions and dense-all, each with plain block scales and with the block-scale search;
* the NVFP4 exports with FP4 activations too (W4A4, as Blackwell GPUs run them: ``salaquant.runtime.load(path,
  activations="fp4")``);
* ModelOpt NVFP4 fake-quant (``modelopt.torch.quantization``) on the same torch model, with exactly the linears
  salaquant's NVFP4 export quantizes: weight-only like the exports above (``W4A16_NVFP4_CFG``, and
  ``NVFP4_AWQ_LITE_CFG`` with its input quantizers off), and W4A4 (``NVFP4_DEFAULT_CFG`` and
  ``NVFP4_AWQ_LITE_CFG`` as they are, input quantizers calibrated on the same samples); likewise its GPTQ and
  Four-Over-Six configurations (``MODELOPT_METHODS``), which calibrate on a CUDA GPU and are scored on the CPU;
* llm-compressor GPTQ W4A16 (with and without its SmoothQuant), GPTQModel GPTQ W4A16 and AutoRound W4A16, each run
  in its own virtual environment by ``benchmarks/peers/`` (``--llmc-venv``, ``--gptqmodel-venv``,
  ``--autoround-venv``) and told to keep the linears salaquant's GPTQ export keeps in bf16 (``--ignore``);
  llm-compressor's GPTQ (with its scheme's weight observer and with its four-over-six one) and AutoRound for
  NVFP4, weight-only and W4A4 (scored with FP4 activations at the peer's own activation scales), told to keep the
  linears salaquant's default NVFP4 export keeps; a peer that fails is recorded with its error and where it
  happened.

Every export is read back by ``salaquant.model.loading.load_model`` (weights dequantized) and scored with
``salaquant.eval.perplexity.compare_models``. ``--smoke`` runs the same code on a random tiny model with a few
short samples (seconds; what the tests run). ``--only`` runs the rows whose name contains one of its strings
(with the exports they need).

``--no-bos`` gives every tool its calibration samples without BOS, the layout of the held-out windows (sala-small
reads BOS-led text as a task prompt; see docs/quality.md). ``--salaquant-device cuda`` calibrates salaquant's own
exports on the GPU, as the GPU peers do; every row is scored on the CPU. ``quality.json`` is rewritten after every
row.

  python benchmarks/quality.py --out OUT [--model models/sala-small] [--no-bos] [--llmc-venv /tmp/venv-llmc]
      [--gptqmodel-venv /tmp/venv-gptqmodel] [--autoround-venv /tmp/venv-autoround [--autoround-device cuda]]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import CALIB, ROOT, TINY, fp4_activations, quality_parser, quiet
from rich.console import Console
from rich.table import Table

from salaquant.calibration.calib_data import CalibOptions, load_calibration
from salaquant.eval.data import load_eval_text
from salaquant.eval.perplexity import compare_models, windows
from salaquant.io.reader import CheckpointReader
from salaquant.model.loading import load_model
from salaquant.model.tiny import preset_config, write_random_checkpoint
from salaquant.runtime.load import load
from salaquant.workflow import load_tokenizer

MODEL = TINY


def salaquant_variants(
    model: Path, calib: CalibOptions, device: str = "cpu"
) -> list[tuple[str, str, Callable[[Path], object]]]:
    from salaquant.driver import run_method
    from salaquant.gptq.command import GPTQMethod, RunOptions
    from salaquant.gptq.layer import GPTQLayerOptions
    from salaquant.gptq.plan import BitsOptions
    from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
    from salaquant.nvfp4.layer import NVFP4LayerOptions

    def gptq(opts: GPTQLayerOptions) -> Callable[[Path], object]:
        run = RunOptions(device=device, show_progress=False, overwrite=True)
        return lambda out: run_method(model, out, [str(CALIB)], calib, GPTQMethod(BitsOptions(), opts, run), quiet())

    def nvfp4(opts: NVFP4LayerOptions, dense_all: bool) -> Callable[[Path], object]:
        run = NVFP4RunOptions(dense_all=dense_all, device=device, show_progress=False, overwrite=True)
        return lambda out: run_method(model, out, [str(CALIB)], calib, NVFP4Method(opts, run), quiet())

    near = NVFP4LayerOptions(rounding="nearest")  # the rounding before GPTQ rounding became the default
    near_plain = NVFP4LayerOptions(mse_iters=0, rounding="nearest")
    return [
        ("RTN W4 g128 (baseline)", "rtn", gptq(GPTQLayerOptions(method="rtn", mse=False, smooth_alpha=None))),
        ("salaquant GPTQ W4A16 (MSE scales, default)", "gptq", gptq(GPTQLayerOptions())),
        ("salaquant GPTQ W4A16, SmoothQuant 0.5", "gptq-smooth", gptq(GPTQLayerOptions(smooth_alpha=0.5))),
        ("salaquant GPTQ W4A16, plain scales", "gptq-plain", gptq(GPTQLayerOptions(mse=False))),
        (
            "salaquant NVFP4 default, plain scales",
            "nvfp4-plain",
            nvfp4(near_plain, False),
        ),
        ("salaquant NVFP4 default (search)", "nvfp4", nvfp4(near, False)),
        (
            "salaquant NVFP4 dense-all, plain scales",
            "nvfp4-da-plain",
            nvfp4(near_plain, True),
        ),
        ("salaquant NVFP4 dense-all (search)", "nvfp4-da", nvfp4(near, True)),
        ("salaquant NVFP4 default, GPTQ rounding (default)", "nvfp4-gptq", nvfp4(NVFP4LayerOptions(), False)),
        ("salaquant NVFP4 dense-all, GPTQ rounding", "nvfp4-da-gptq", nvfp4(NVFP4LayerOptions(), True)),
    ]


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def nvfp4_quantized_linears(export: Path) -> set[str]:
    """Module names an NVFP4 export quantized (those with a block-scale tensor)."""
    reader = CheckpointReader(export)
    return {name.removesuffix(".weight_scale") for name in reader if name.endswith(".weight_scale")}


def gptq_linears(export: Path) -> tuple[set[str], list[str]]:
    """Module names a GPTQ export quantized, and the regexes of the linears its config keeps in 16 bits."""
    reader = CheckpointReader(export)
    quantized = {name.removesuffix(".qweight") for name in reader if name.endswith(".qweight")}
    dynamic = (reader.config().get("quantization_config") or {}).get("dynamic") or {}
    return quantized, [key[2:] for key in dynamic if key.startswith("-:")]


def _modelopt_on_cpu() -> str | None:
    """ModelOpt's NVFP4 fake-quant op runs only on CUDA (a Triton kernel or its CUDA extension; on a CPU tensor it
    fails with ``amax must be a CUDA tensor for dynamic block quantization``). On CPU tensors this routes the op
    through ModelOpt's own ``NVFP4QTensor`` quantize and dequantize (its pure-torch path, the numerics salaquant's
    export is tested bit-identical against), with the global scale ModelOpt derives from the same amax.
    Returns a note when the emulation is installed."""
    import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    original = tq.dynamic_block_quant
    if getattr(original, "_salaquant_cpu", False):
        return "NVFP4 fake quant on CPU through ModelOpt's NVFP4QTensor"

    def dynamic_block_quant(inputs: torch.Tensor, block_size: int, amax: torch.Tensor | None, *rest: Any) -> Any:
        num_bits, scale_bits = rest[1], rest[2]
        if inputs.is_cuda or amax is None or tuple(num_bits) != (2, 1) or tuple(scale_bits or ()) != (4, 3):
            return original(inputs, block_size, amax, *rest)
        s2 = amax.float().amax() / (6.0 * 448.0)
        q, scale, s2 = NVFP4QTensor.quantize(inputs.float(), block_size, weights_scaling_factor_2=s2)
        out = q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: block_size})
        return out.to(inputs.dtype)

    dynamic_block_quant._salaquant_cpu = True  # type: ignore[attr-defined]
    tq.dynamic_block_quant = dynamic_block_quant
    return "NVFP4 fake quant on CPU through ModelOpt's NVFP4QTensor"


MODELOPT_METHODS = ("default", "AWQ-lite", "GPTQ", "Four-Over-Six")
"""ModelOpt's NVFP4 configurations in the table: its max calibration (``W4A16_NVFP4_CFG`` / ``NVFP4_DEFAULT_CFG``),
AWQ-lite (``NVFP4_AWQ_LITE_CFG``), GPTQ (its ``nvfp4_default-kv_none-gptq`` recipe: static weight block scales,
``algorithm: gptq`` layer by layer) and Four-Over-Six (``NVFP4_FOUR_OVER_SIX_CFG``: each weight block's scale chosen
by MSE between its amax and 1.5 times it). The last two run on CUDA only."""

_CUDA_ONLY = {
    "GPTQ": "ModelOpt's GPTQ fake-quantizes column by column (8 of 54 linears in 15 minutes on a 2-core CPU)",
    "Four-Over-Six": "ModelOpt's Four-Over-Six block quantizer is a CUDA Triton kernel",
}


def _sala_layers_for_modelopt() -> None:
    """Tell ModelOpt's layer-by-layer calibration where SALA's decoder layers are (it finds them only in
    transformers models): the one step a user adding an architecture to ModelOpt takes."""
    from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

    from salaquant.model.modeling import SalaForCausalLM

    LayerActivationCollector.register_decoder_layer_support(
        lambda m: isinstance(m, SalaForCausalLM), lambda m: m.model.layers
    )


def _modelopt_config(mtq: Any, method: str, w4a4: bool) -> tuple[str, dict[str, Any]]:
    """The named ModelOpt config of ``method`` (deep-copied), made weight-only unless ``w4a4``."""
    import copy

    if method == "AWQ-lite":
        name = "NVFP4_AWQ_LITE_CFG"
    elif method == "Four-Over-Six":
        name = "NVFP4_FOUR_OVER_SIX_CFG"
    else:
        name = "NVFP4_DEFAULT_CFG" if w4a4 else "W4A16_NVFP4_CFG"
    cfg = copy.deepcopy(getattr(mtq, name))
    if method == "GPTQ":  # the recipe: weight block scales static, GPTQ layer by layer
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
                entry["cfg"]["block_sizes"]["type"] = "static"
        cfg["algorithm"] = {"method": "gptq", "layerwise": {"enable": True}}
        name += " + GPTQ (layerwise)"
    if not w4a4:
        cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
    return name, cfg


def modelopt_nvfp4(
    model: Path, samples: list[torch.Tensor], quantized: set[str], method: str, w4a4: bool = False
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """ModelOpt's NVFP4 fake quantization (``method``, one of ``MODELOPT_METHODS``) of the same linears, calibrated
    on the same samples: weight-only, or with its input quantizers on (``w4a4``). The CUDA-only methods calibrate
    on the GPU; their fake-quantized weights are then folded into the model, which is scored on the CPU like every
    other row (its input quantizers, for W4A4, through ``_modelopt_on_cpu``)."""
    import modelopt
    import modelopt.torch.quantization as mtq

    device = "cpu"
    if method in _CUDA_ONLY:
        if not torch.cuda.is_available():
            raise RuntimeError(f"needs a CUDA GPU: {_CUDA_ONLY[method]}")
        device = "cuda"
    note = _modelopt_on_cpu()
    _sala_layers_for_modelopt()

    net = load_model(model).float().to(device)  # fp32 master weights: the fake-quant error is then ModelOpt's alone
    cfg_name, cfg = _modelopt_config(mtq, method, w4a4)
    linears = {n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    for name in sorted(linears - quantized):
        cfg["quant_cfg"].append({"quantizer_name": f"{name}.*", "enable": False})

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in samples:
                m(ids[None].to(device), attention_mode="dense")

    t0 = time.perf_counter()
    net = mtq.quantize(net, cfg, forward_loop)
    quantize_s = time.perf_counter() - t0
    enabled = sorted(
        n.removesuffix(".weight_quantizer")
        for n, m in net.named_modules()
        if n.endswith(".weight_quantizer") and getattr(m, "is_enabled", False)
    )
    inputs = sum(
        1 for n, m in net.named_modules() if n.endswith(".input_quantizer") and getattr(m, "is_enabled", False)
    )
    if device != "cpu":
        mtq.fold_weight(net)  # the weights as ModelOpt quantized them; scored on the CPU like the other rows
        net = net.cpu()
        note = f"calibrated on {torch.cuda.get_device_name()}, weights folded, scored on the CPU" + (
            f"; {note}" if w4a4 else ""
        )
    info = {
        "modelopt": modelopt.__version__,
        "config": cfg_name,
        "input_quantizers": f"{inputs} on (W4A4)" if w4a4 else "off (weight-only)",
        "quantized_linears": len(enabled),
        "same_linears_as_salaquant": set(enabled) == quantized,
        "quantize_s": round(quantize_s, 1),
        "note": note,
    }
    return net.eval(), info


RUNNERS = {  # peer -> its runner in benchmarks/peers/, the script that makes its virtual environment, the tool
    "llmc": ("llmcompressor_gptq.py", "setup_llmcompressor.sh", "llm-compressor"),
    "gptqmodel": ("gptqmodel_gptq.py", "setup_gptqmodel.sh", "GPTQModel"),
    "autoround": ("autoround.py", "setup_autoround.sh", "AutoRound"),
}
PEERS = [  # row, peer, folder (OUT/peer-FOLDER), the salaquant export whose bf16 linears it keeps, runner arguments
    ("llm-compressor GPTQ W4A16", "llmc", "llmc", "gptq", []),
    ("llm-compressor GPTQ W4A16 + SmoothQuant", "llmc", "llmc-sq", "gptq", ["--smoothquant"]),
    ("GPTQModel GPTQ W4A16", "gptqmodel", "gptqmodel", "gptq", []),
    ("AutoRound W4A16", "autoround", "autoround-w4a16", "gptq", ["--scheme", "W4A16"]),
    ("llm-compressor GPTQ NVFP4A16, default exclusions", "llmc", "llmc-nvfp4a16", "nvfp4", ["--scheme", "NVFP4A16"]),
    ("llm-compressor GPTQ NVFP4, default exclusions, W4A4", "llmc", "llmc-nvfp4", "nvfp4", ["--scheme", "NVFP4"]),
    (
        "llm-compressor GPTQ NVFP4A16 four-over-six observer, default exclusions",
        "llmc",
        "llmc-nvfp4a16-46",
        "nvfp4",
        ["--scheme", "NVFP4A16", "--weight-observer", "fouroversix"],
    ),
    (
        "llm-compressor GPTQ NVFP4 four-over-six observer, default exclusions, W4A4",
        "llmc",
        "llmc-nvfp4-46",
        "nvfp4",
        ["--scheme", "NVFP4", "--weight-observer", "fouroversix"],
    ),
    ("AutoRound NVFP4A16, default exclusions", "autoround", "autoround-nvfp4a16", "nvfp4", ["--scheme", "NVFP4A16"]),
    ("AutoRound NVFP4, default exclusions, W4A4", "autoround", "autoround-nvfp4", "nvfp4", ["--scheme", "NVFP4"]),
]


def run_peer(script: str, venv: Path | None, args: list[str], out: Path, setup: str) -> dict[str, Any]:
    """Run ``benchmarks/peers/<script>`` in ``venv``; its ``peer.json`` (or why it did not run)."""
    if venv is None:
        return {"error": f"not run: no virtual environment given (create one with benchmarks/peers/{setup})"}
    python = venv / "bin" / "python"
    cmd = [str(python), str(ROOT / "benchmarks" / "peers" / script), *args, "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True)  # peers may write logs to cwd
    info: dict[str, Any] = {"command": " ".join(cmd), "wall_s": round(time.perf_counter() - t0, 1)}
    peer_json = out / "peer.json"
    if peer_json.exists():
        info.update(json.loads(peer_json.read_text()))
    if proc.returncode != 0:
        info.setdefault("error", f"exit status {proc.returncode}")
        info["stderr_tail"] = proc.stderr[-1500:]
    return info


def _shown(path: Path) -> Path:
    """``path`` relative to the checkout where it lies inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _score(reference: torch.nn.Module, model: torch.nn.Module, wins: list[torch.Tensor]) -> dict[str, float]:
    with torch.no_grad():
        return compare_models(reference, model, wins)


def main() -> None:
    ap = quality_parser(__doc__)
    ap.add_argument("--llmc-venv", type=Path)
    ap.add_argument("--gptqmodel-venv", type=Path)
    ap.add_argument("--autoround-venv", type=Path)
    ap.add_argument("--autoround-iters", type=int, help="AutoRound's tuning steps per block (default: its 200)")
    ap.add_argument("--autoround-lr", type=float, help="AutoRound's learning rate (default: its 1 / iters)")
    ap.add_argument("--autoround-device", default="cpu", help="where AutoRound tunes its blocks: cpu or cuda")
    ap.add_argument(
        "--salaquant-device", default="cpu", help="where salaquant's own exports calibrate: cpu or cuda (scored on cpu)"
    )
    ap.add_argument("--smoke", action="store_true", help="random tiny model, 4 x 256 calibration tokens")
    ap.add_argument("--only", nargs="*", help="run only the rows whose name contains one of these strings")
    ap.add_argument("--model", type=Path, default=MODEL, help="the bf16 checkpoint every tool quantizes (sala-tiny)")
    ap.add_argument(
        "--no-bos",
        action="store_true",
        help="every tool's calibration samples without BOS, the layout of the held-out windows (for a model that "
        "reads BOS-led text otherwise, as sala-small does)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model.resolve()
    if args.smoke:
        model = args.out / "random-tiny"
        if not (model / "config.json").exists():
            write_random_checkpoint(model, preset_config("tiny", vocab_size=4096), seed=0)
            for f in MODEL.glob("tokenizer*"):
                (model / f.name).write_bytes(f.read_bytes())
            for f in ("special_tokens_map.json",):
                if (MODEL / f).exists():
                    (model / f).write_bytes((MODEL / f).read_bytes())
        args.max_samples, args.max_len, args.windows, args.window_len = 4, 256, 2, 256
    tok = load_tokenizer(model)
    wins = windows(load_eval_text(None, tok, tok.eos_token_id).tokens, args.window_len, args.windows)
    calib = CalibOptions(max_samples=args.max_samples, max_len=args.max_len, bos=not args.no_bos)
    samples = [s.ids for s in load_calibration([str(CALIB)], tok, calib).samples]
    reference = load_model(model)
    rows: list[dict[str, Any]] = [{"variant": "bf16", "tool": "-", **_score(reference, reference, wins)}]

    def save() -> dict[str, Any]:
        """Write ``quality.json`` with the rows so far (after every row: a run cut short keeps what it measured)."""
        base = rows[0]["ppl"]
        for r in rows:
            if "ppl" in r:
                r["ppl_increase"] = r["ppl"] / base - 1
        result = {
            "model": "random tiny (smoke)" if args.smoke else str(_shown(model)),
            "calibration": {
                "source": str(CALIB.relative_to(ROOT)),
                "samples": len(samples),
                "max_len": args.max_len,
                "bos": not args.no_bos,
                "salaquant_device": args.salaquant_device,
            },
            "eval": {"windows": len(wins), "window_tokens": args.window_len, "attention": "dense", "device": "cpu"},
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "rows": rows,
            "targets": targets(rows),
        }
        (args.out / "quality.json").write_text(json.dumps(result, indent=2))
        return result

    def wanted(name: str) -> bool:
        return not args.only or any(k in name for k in args.only)

    def record(name: str, tool: str, build: Callable[[], tuple[torch.nn.Module, dict[str, Any]]]) -> None:
        if not wanted(name):
            return
        t0 = time.perf_counter()
        try:
            net, info = build()
            rows.append({"variant": name, "tool": tool, **_score(reference, net, wins), **info})
        except Exception as exc:  # a failing variant is a result: recorded with where it failed
            tb = traceback.extract_tb(exc.__traceback__)
            where = f"{tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name}" if tb else "?"
            rows.append({"variant": name, "tool": tool, "error": f"{type(exc).__name__}: {exc}"[:500], "where": where})
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 1)
        r = rows[-1]
        done = f"ppl {r['ppl']:.3f}, KL {r['kl']:.4f}" if "ppl" in r else f"failed: {r['error']}"
        console.print(f"{name}: {done} ({r['seconds']} s)")
        save()

    nvfp4_exports = {"nvfp4": "default", "nvfp4-da": "dense-all"}
    nvfp4_wanted = any(wanted(n) for n in ("NVFP4", "W4A4", "ModelOpt"))
    needed = {export for label, *_, export, _ in PEERS if wanted(label)}  # the exports the wanted peer rows follow
    needed |= set(nvfp4_exports) if nvfp4_wanted else set()
    for name, folder, quantize in salaquant_variants(model, calib, args.salaquant_device):
        path = args.out / folder
        if not wanted(name) and folder not in needed:
            continue

        def build(quantize: Callable[[Path], object] = quantize, path: Path = path) -> tuple[torch.nn.Module, dict]:
            quantize(path)
            return load_model(path), {"path": str(path)}

        if wanted(name):
            record(name, "salaquant", build)
        else:
            quantize(path)  # an export the rows below need

    for export, label in (
        ("nvfp4-gptq", "salaquant NVFP4 default, GPTQ rounding (default), W4A4"),
        ("nvfp4-da-gptq", "salaquant NVFP4 dense-all, GPTQ rounding, W4A4"),
    ):
        if (path := args.out / export / "config.json").exists():
            record(
                label, "salaquant", lambda p=path.parent: (load(p, activations="fp4", kernels=False), {"path": str(p)})
            )
    for export, exclusions in nvfp4_exports.items():
        if not (args.out / export / "config.json").exists():
            continue
        label = f"salaquant NVFP4 {exclusions} (search), W4A4"
        path = args.out / export
        record(label, "salaquant", lambda p=path: (load(p, activations="fp4", kernels=False), {"path": str(p)}))
        quantized = nvfp4_quantized_linears(path)
        for w4a4 in (False, True):
            for method in MODELOPT_METHODS:
                label = f"ModelOpt NVFP4 {method}, {exclusions} exclusions" + (", W4A4" if w4a4 else "")
                record(label, "ModelOpt", lambda q=quantized, m=method, w=w4a4: modelopt_nvfp4(model, samples, q, m, w))

    # Each peer keeps the linears in bf16 that its salaquant export keeps (GPTQ: those gptq_marlin cannot serve; the
    # default NVFP4 export); a W4A4 export is scored with FP4 activations at its own scales (input_scales.json).
    ours_gptq, kept_regexes = gptq_linears(args.out / "gptq") if (args.out / "gptq").exists() else (set(), [])
    ours_nvfp4 = nvfp4_quantized_linears(args.out / "nvfp4") if (args.out / "nvfp4").exists() else set()
    kept_nvfp4 = [re.escape(n) for n in sorted(_linear_names(reference) - ours_nvfp4)] if ours_nvfp4 else []
    base_args = ["--model", str(model), "--calib", str(CALIB), "--max-samples", str(args.max_samples)]
    base_args += ["--max-len", str(args.max_len)] + (["--no-bos"] if args.no_bos else [])
    against = {
        export: (len(ours), base_args + (["--ignore", *kept] if kept else []))
        for export, ours, kept in (("gptq", ours_gptq, kept_regexes), ("nvfp4", ours_nvfp4, kept_nvfp4))
    }
    venvs = {"llmc": args.llmc_venv, "gptqmodel": args.gptqmodel_venv, "autoround": args.autoround_venv}

    def peer_build(peer: str, out: Path, export: str, extra: list[str]) -> Callable[[], tuple[torch.nn.Module, dict]]:
        def build() -> tuple[torch.nn.Module, dict]:
            expected, peer_args = against[export]
            info = run_peer(RUNNERS[peer][0], venvs[peer], peer_args + extra, out, RUNNERS[peer][1])
            if "error" in info:
                raise RuntimeError(json.dumps({k: info[k] for k in ("error", "where") if k in info}))
            info["same_linears_as_salaquant"] = info.get("quantized_linears") == expected
            net = load_model(out)
            if (out / "input_scales.json").exists():
                net = fp4_activations(net, json.loads((out / "input_scales.json").read_text()))
            return net, info

        return build

    for label, peer, folder, export, extra in PEERS:
        if peer == "autoround" and args.autoround_iters is not None:  # not AutoRound's default: said in the row
            label, extra = f"{label} ({args.autoround_iters} iters)", [*extra, "--iters", str(args.autoround_iters)]
        if peer == "autoround" and args.autoround_lr is not None:
            label, extra = f"{label} (lr {args.autoround_lr:g})", [*extra, "--lr", str(args.autoround_lr)]
        if peer == "autoround":
            extra = [*extra, "--device", args.autoround_device]
        record(label, RUNNERS[peer][2], peer_build(peer, args.out / f"peer-{folder}", export, extra))

    result = save()
    console.print(table(result))
    for line in result["targets"]:
        console.print(line)


def _inc(rows: list[dict[str, Any]], name: str) -> float | None:
    for r in rows:
        if r["variant"] == name and "ppl_increase" in r:
            return float(r["ppl_increase"])
    return None


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The comparisons the benchmark exists for, stated with the measured figures."""
    out = []
    ours = _inc(rows, "salaquant GPTQ W4A16 (MSE scales, default)")
    rtn = _inc(rows, "RTN W4 g128 (baseline)")
    if ours is not None and rtn is not None:
        verdict = "met" if ours <= 0.5 * rtn else "missed"
        out.append(f"GPTQ ppl increase {100 * ours:.2f}% vs 50% of RTN's {100 * rtn:.2f}%: {verdict}")
    gptq_peers = [label for label, *_, export, _ in PEERS if export == "gptq"]
    for peer in (r["variant"] for r in rows if any(r["variant"].startswith(label) for label in gptq_peers)):
        theirs = _inc(rows, peer)
        if ours is not None and theirs is not None:
            out.append(f"GPTQ {100 * ours:.2f}% vs {peer} {100 * theirs:.2f}%: {'met' if ours < theirs else 'missed'}")
        elif ours is not None:
            out.append(f"GPTQ vs {peer}: peer did not run (see its row)")
    for exclusions, ours_name in (
        ("default", "salaquant NVFP4 default (search)"),
        ("dense-all", "salaquant NVFP4 dense-all (search)"),
    ):
        mine = _inc(rows, ours_name)
        for cfg in ("default", "AWQ-lite"):
            theirs = _inc(rows, f"ModelOpt NVFP4 {cfg}, {exclusions} exclusions")
            if mine is not None and theirs is not None:
                verdict = "met" if mine < theirs else "missed"
                out.append(f"NVFP4 {exclusions} {100 * mine:.2f}% vs ModelOpt {cfg} {100 * theirs:.2f}%: {verdict}")
    by_name = {r["variant"]: r for r in rows if "ppl_increase" in r}
    for exclusions in ("default", "dense-all"):
        mine_row = by_name.get(f"salaquant NVFP4 {exclusions} (search), W4A4")
        for cfg in ("default", "AWQ-lite"):
            theirs_row = by_name.get(f"ModelOpt NVFP4 {cfg}, {exclusions} exclusions, W4A4")
            if mine_row is None or theirs_row is None:
                continue
            ok = mine_row["ppl_increase"] < theirs_row["ppl_increase"] and mine_row["kl"] < theirs_row["kl"]
            out.append(
                f"NVFP4 W4A4 {exclusions}: {100 * mine_row['ppl_increase']:.2f}% KL {mine_row['kl']:.4f} vs ModelOpt "
                f"{cfg} {100 * theirs_row['ppl_increase']:.2f}% KL {theirs_row['kl']:.4f}: {'met' if ok else 'missed'}"
            )
    for exclusions, label in (
        ("default", "salaquant NVFP4 default, GPTQ rounding (default)"),
        ("dense-all", "salaquant NVFP4 dense-all, GPTQ rounding"),
    ):
        for suffix in ("", ", W4A4"):
            mine_row = by_name.get(label + suffix)
            peers = [r for r in by_name.values() if r["tool"] != "salaquant" and "NVFP4" in r["variant"]]
            peers = [r for r in peers if f"{exclusions} exclusions" in r["variant"]]
            peers = [r for r in peers if ("W4A4" in r["variant"]) == bool(suffix)]
            for theirs_row in peers if mine_row else []:
                ok = mine_row["ppl_increase"] < theirs_row["ppl_increase"] and mine_row["kl"] < theirs_row["kl"]
                out.append(
                    f"{label}{suffix}: {100 * mine_row['ppl_increase']:.2f}% KL {mine_row['kl']:.4f} vs "
                    f"{theirs_row['variant']} {100 * theirs_row['ppl_increase']:.2f}% KL {theirs_row['kl']:.4f}: "
                    f"{'met' if ok else 'missed'}"
                )
    return out


def table(result: dict[str, Any]) -> Table:
    ev = result["eval"]
    t = Table(title=f"{result['model']}: held-out {ev['windows']} x {ev['window_tokens']} tokens, dense, CPU")
    for col in ("variant", "ppl", "ppl increase", "KL(bf16||q)", "top-1 agree", "note"):
        t.add_column(col, justify="left" if col in ("variant", "note") else "right")
    for r in result["rows"]:
        if "ppl" not in r:
            t.add_row(r["variant"], "-", "-", "-", "-", f"did not run: {r['error'][:160]}")
            continue
        note = "" if r.get("same_linears_as_salaquant", True) else "different linears quantized"
        t.add_row(
            r["variant"],
            f"{r['ppl']:.3f}",
            f"{100 * r['ppl_increase']:+.2f}%",
            f"{r['kl']:.4f}",
            f"{100 * r['top1']:.2f}%",
            note,
        )
    return t


if __name__ == "__main__":
    main()
