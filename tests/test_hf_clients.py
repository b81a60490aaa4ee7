"""GPTQ exports loaded by the HF ecosystem's own clients, as written: transformers' GPTQ path (optimum with
GPTQModel's kernels, ``AutoModelForCausalLM.from_pretrained``) and ``GPTQModel.load``; and the registration of
SALA with both in every import order.

Each client runs in a fresh interpreter (``tests/hf_client.py``): importing GPTQModel patches transformers for
the rest of the process. The reference is salaquant's runtime in fp32; the modules a client quantizes are
compared with the GPTQ tensors the files hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.gptq_v1.dynamic import plan_for
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions
from salaquant.io.reader import CheckpointReader

pytestmark = pytest.mark.skipif(
    find_spec("gptqmodel") is None or find_spec("optimum") is None,
    reason="GPTQModel / optimum are not installed (pip install --no-deps -r tests/hf-requirements.txt)",
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = [str(ROOT / "calib" / "sala-tiny-calib.jsonl")]
CLIENT = ROOT / "tests" / "hf_client.py"
BITS = {
    "default": BitsOptions(),
    "bf16_layer": BitsOptions(layer_bits="2:16"),
    "exclude": BitsOptions(exclude=(r"layers\.[3-5]\.mlp\.down_proj",)),
    "mixed": BitsOptions(layer_bits="1:8,2:16"),  # 8-bit layer 1, bf16 layer 2
}
UNIFORM = ("default", "bf16_layer", "exclude")  # one bit width: what transformers' GPTQ path can build
# bf16 / fp16 logits of a client against the fp32 runtime: rounding only. Measured on these exports: KL
# 1.9e-4 (bf16) and 3e-6 (fp16); the quantization itself costs about 0.02, a wrong zero point or scale far more.
KL_BF16, KL_FP16 = 2e-3, 1e-4


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_clients")
    run = RunOptions(device="cpu", show_progress=False)
    small = CalibOptions(max_samples=2, max_len=128)
    quiet = Console(quiet=True)
    return {
        k: run_method(MODEL, root / k, CALIB, small, GPTQMethod(b, GPTQLayerOptions(), run), quiet)
        for k, b in BITS.items()
    }


def _client(name: str, paths: list[Path]) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, str(CLIENT), name, *map(str, paths)], capture_output=True, text=True, timeout=900
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(lines[-1].removeprefix("RESULT ")).items()}


def _stored(path: Path) -> dict[str, int]:
    """Module -> bits of every linear the export stores as GPTQ tensors (bits as its dynamic rules give them)."""
    reader = CheckpointReader(path)
    qc = reader.config()["quantization_config"]
    modules = [name.removesuffix(".qweight") for name in reader if name.endswith(".qweight")]
    return {m: plan_for(qc.get("dynamic") or {}, m, qc["bits"], qc["group_size"]).bits for m in modules}


@pytest.fixture(scope="module")
def transformers_results(exports: dict[str, Path]) -> dict[str, Any]:
    return _client("transformers", [exports[k] for k in BITS])


@pytest.fixture(scope="module")
def gptqmodel_results(exports: dict[str, Path]) -> dict[str, Any]:
    return _client("gptqmodel", [exports[k] for k in BITS])


@pytest.mark.parametrize("kind", UNIFORM)
def test_transformers_loads_the_export_as_written(exports, transformers_results, kind: str) -> None:
    got = transformers_results[kind]
    assert "error" not in got, got.get("error")
    assert got["class"] == "MiniCPMSALAForCausalLM"
    assert got["keys"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert got["quantized"] == _stored(exports[kind])  # quantized linears exactly where the files hold GPTQ
    assert got["fp32"]["max_abs"] == 0.0  # the same dequantized weights, the same fp32 arithmetic
    assert got["bf16"]["kl"] < KL_BF16 and got["bf16"]["top1"] >= 0.9
    assert got["fp16"]["kl"] < KL_FP16 and got["fp16"]["top1"] >= 0.95


def test_transformers_refuses_per_module_bits(transformers_results) -> None:
    """optimum builds every quantized linear with the top-level bits: an export with 8-bit layers must fail to
    load (size mismatch), not load wrong."""
    got = transformers_results["mixed"]
    assert "error" in got and "mismatched" in got["error"], got


@pytest.mark.parametrize("kind", list(BITS))
def test_gptqmodel_loads_the_export_as_written(exports, gptqmodel_results, kind: str) -> None:
    got = gptqmodel_results[kind]
    assert (got["class"], got["definition"]) == ("MiniCPMSALAForCausalLM", "SalaQModel")
    assert got["quantized"] == _stored(exports[kind])  # per-module bits from dynamic, lightning z_proj included
    assert got["dequantize_unequal"] == []  # GPTQModel's dequantization = the GPTQ v1 reading, bit for bit
    assert got["fp16"]["kl"] < KL_FP16 and got["fp16"]["top1"] >= 0.95
    if kind == "mixed":
        assert sorted(set(got["quantized"].values())) == [4, 8]


REGISTERED = """
import sys
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
config = AutoConfig.for_model("minicpm_sala")
assert MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__ == "MiniCPMSALAForCausalLM"
if "gptqmodel" in sys.modules:
    from gptqmodel.models.auto import MODEL_MAP, SUPPORTED_MODELS
    assert MODEL_MAP["minicpm_sala"].__name__ == "SalaQModel" and "minicpm_sala" in SUPPORTED_MODELS
print("registered")
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import salaquant; import transformers.quantizers",  # quantizers loads the auto modules half-way
        "import transformers.quantizers; import salaquant",
        "import salaquant; import gptqmodel",
        "import gptqmodel; import salaquant",
        "import salaquant; from transformers import AutoModelForCausalLM",
        "import salaquant; import optimum.gptq",
    ],
)
def test_registration_in_any_import_order(imports: str) -> None:
    code = imports.replace("; ", "\n") + "\n" + REGISTERED
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("registered"), res.stderr[-3000:]
