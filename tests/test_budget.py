"""``--budget``: the solver against a brute-force search, the budget arithmetic against the bytes an export holds,
the measured damage against a whole-model forward, and bad budgets refused before any work."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open

from salaquant.budget.measure import measure_costs, search_windows
from salaquant.budget.search import BudgetPlan, SearchOptions, saved_choice
from salaquant.budget.size import Budget, BudgetError, Unit, parse_budget
from salaquant.budget.solver import solve
from salaquant.calibration.calib_data import CalibOptions
from salaquant.driver import run_method
from salaquant.formats.gptq_v1.dynamic import plan_for
from salaquant.gptq.budget import gptq_probe, gptq_units
from salaquant.gptq.command import GPTQMethod, RunOptions
from salaquant.gptq.layer import GPTQLayerOptions
from salaquant.gptq.plan import BitsOptions, PlanError, build_plan
from salaquant.io.reader import CheckpointReader
from salaquant.model.config import SalaConfig
from salaquant.model.loading import load_model
from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
from salaquant.nvfp4.layer import NVFP4LayerOptions

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = [str(ROOT / "calib" / "sala-tiny-calib.jsonl")]
SMALL = CalibOptions(max_samples=2, max_len=128)
QUIET = Console(quiet=True)


def _brute_force(sizes: list[list[int]], costs: list[list[float]], budget: int) -> float | None:
    best = None
    for combo in itertools.product(*[range(len(s)) for s in sizes]):
        if sum(sizes[u][k] for u, k in enumerate(combo)) <= budget:
            c = sum(costs[u][k] for u, k in enumerate(combo))
            best = c if best is None else min(best, c)
    return best


def test_solver_finds_what_brute_force_finds() -> None:
    """400 random instances of up to 7 units with 1-3 options (sizes with many ties, costs with some): the solver's
    choice fits the budget and costs exactly the least any choice fitting it costs; None exactly when none fits."""
    gen = random.Random(7)
    for trial in range(400):
        n = gen.randint(1, 7)
        sizes = [[gen.randint(1, 12) for _ in range(gen.randint(1, 3))] for _ in range(n)]
        costs = [[gen.choice([0.0, 0.25, 0.5, gen.random()]) for _ in s] for s in sizes]
        budget = gen.randint(0, 60)
        best = _brute_force(sizes, costs, budget)
        got = solve(sizes, costs, budget)
        if best is None:
            assert got is None, trial
            continue
        assert got is not None and len(got) == n, trial
        assert sum(sizes[u][k] for u, k in enumerate(got)) <= budget, trial
        assert math.isclose(sum(costs[u][k] for u, k in enumerate(got)), best, abs_tol=1e-12), trial


def test_solver_by_hand() -> None:
    """Two units (4-bit 10 B at cost 1 or 8-bit 20 B at cost 0): 30 B buys one 8-bit, the one that saves more."""
    sizes = [[10, 20], [10, 20]]
    assert solve(sizes, [[1.0, 0.0], [3.0, 0.0]], 30) == [0, 1]
    assert solve(sizes, [[1.0, 0.0], [3.0, 0.0]], 40) == [1, 1]
    assert solve(sizes, [[1.0, 0.0], [3.0, 0.0]], 19) is None
    with pytest.raises(ValueError, match="one cost per size"):
        solve([[1, 2]], [[0.0]], 5)


def test_parse_budget() -> None:
    assert parse_budget("6.5GB") == Budget("6.5GB", bytes=6_500_000_000)
    assert parse_budget("2GiB").bytes == 2 * 2**30
    assert parse_budget("4.5bits") == Budget("4.5bits", bits=4.5)
    assert parse_budget("5 bit").bits == 5.0
    assert parse_budget("4.5bits").target(fixed=1000, linear_weights=800) == 1000 + 450
    assert parse_budget("700000").bytes == 700000
    for bad in ("big", "4.5", "-3bits", "17bits", "4.5 GBs"):  # "4.5": bytes or bits? refused
        with pytest.raises(BudgetError, match="budget"):
            parse_budget(bad)


def _tensor_bytes(export: Path) -> int:
    """Bytes of every tensor in the export's safetensors files, from the files' own headers."""
    total = 0
    for f in export.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open has no iterator)
                t = fh.get_slice(key)
                total += (
                    math.prod(t.get_shape())
                    * {"I32": 4, "F16": 2, "BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[t.get_dtype()]
                )
    return total


@pytest.fixture(scope="module")
def gptq_budget_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("budget") / "gptq"
    bits = BitsOptions(budget="7bits", budget_windows=4, budget_seq_len=64)
    run = RunOptions(device="cpu", show_progress=False)
    return run_method(MODEL, out, CALIB, SMALL, GPTQMethod(bits, GPTQLayerOptions(), run), QUIET)


def test_gptq_budget_bytes_are_the_exported_bytes(gptq_budget_export: Path) -> None:
    """The predicted size equals the bytes of the tensors the export's files hold (read from their headers) and is
    within the budget; every unit's linears are served at the chosen bits (the export's dynamic rules, resolved as
    vLLM / SGLang resolve them), and the choice mixes 4-bit, 8-bit and bf16."""
    report = json.loads((gptq_budget_export / "quant_report.json").read_text())["budget"]
    assert report["predicted_bytes"] == report["achieved_bytes"] == _tensor_bytes(gptq_budget_export)
    assert report["predicted_bytes"] <= report["budget_bytes"]
    with CheckpointReader(MODEL) as reader:
        config = SalaConfig.from_dict(reader.config())
        linear = [k for k in reader if k.startswith("model.layers.") and len(reader.shape(k)) == 2]
        weights = sum(math.prod(reader.shape(k)) for k in linear)
        outside = sum(reader.nbytes(k) for k in reader if k not in linear)
    assert report["budget_bytes"] == outside + int(7 * weights / 8)  # norms: bf16 in source and export alike
    qc = json.loads((gptq_budget_export / "config.json").read_text())["quantization_config"]
    chosen = set()
    for unit in report["units"]:
        for member in unit["members"]:
            full = f"model.layers.{unit['unit'].split('.')[2]}.{member}"
            plan = plan_for(qc.get("dynamic") or {}, full, qc["bits"], qc["group_size"])
            assert {"4-bit": 4, "8-bit": 8, "bf16": None}[unit["choice"]] == plan.bits, full
        chosen.add(unit["choice"])
    assert chosen == {"4-bit", "8-bit", "bf16"}
    assert config.num_hidden_layers == len({u["unit"].split(".")[2] for u in report["units"]})


def test_gptq_budget_measured_kl_is_the_export_against_its_source(gptq_budget_export: Path) -> None:
    """The report's measured KL is the export's KL to the source on the search windows, computed here by whole-model
    forwards of the two checkpoints (float32, dense attention)."""
    report = json.loads((gptq_budget_export / "quant_report.json").read_text())["budget"]
    from salaquant.calibration.calib_data import load_calibration
    from salaquant.workflow import load_tokenizer

    samples = [s.ids for s in load_calibration(CALIB, load_tokenizer(MODEL), SMALL).samples]
    ids = search_windows(samples, report["requested_windows"], report["seq_len"])
    src, exp = (load_model(p, dtype=torch.float32) for p in (MODEL, gptq_budget_export))
    with torch.no_grad():
        a = torch.log_softmax(src(ids, attention_mode="dense").logits.float(), -1)
        b = torch.log_softmax(exp(ids, attention_mode="dense").logits.float(), -1)
    kl = float((a.exp() * (a - b)).sum()) / ids.numel()
    assert math.isclose(report["measured_kl"], kl, rel_tol=1e-3)
    assert report["measured_kl"] > 0


def test_measured_cost_is_the_whole_model_kl_with_one_unit_changed() -> None:
    """The layer-streamed cost of a unit's option equals the KL computed by a whole-model forward with only that
    unit's weights replaced (the probe's round to nearest), for units in the first, a middle and the last layer."""
    reader = CheckpointReader(MODEL)
    config = SalaConfig.from_dict(reader.config())
    plan = build_plan(config, BitsOptions())
    units = [u for u in gptq_units(config, plan) if len(u.options) > 1]
    picked = [units[0], units[len(units) // 2], units[-1]]
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    probe = gptq_probe(GPTQLayerOptions(), plan)
    costs = measure_costs(reader, config, ids, picked, probe, torch.device("cpu"))
    source = load_model(MODEL, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(source(ids, attention_mode="dense").logits.float(), -1)
        for unit, got in zip(picked, costs, strict=True):
            assert got[-1] == 0.0  # bf16: unchanged
            for k, option in enumerate(unit.options[:-1]):
                changed = load_model(MODEL, dtype=torch.float32)
                layer = changed.model.layers[unit.layer]
                for m, w in probe(unit, option, layer).items():
                    layer.get_submodule(m).weight.data = w.float()
                q = torch.log_softmax(changed(ids, attention_mode="dense").logits.float(), -1)
                kl = float((ref.exp() * (ref - q)).sum()) / ids.numel()
                assert math.isclose(got[k], kl, rel_tol=1e-3, abs_tol=1e-9), (unit.full_name, option)
            assert got[0] > got[1] > 0, unit.full_name  # 4-bit damages more than 8-bit


def test_nvfp4_budget_honours_the_exclusion_cascade(tmp_path: Path) -> None:
    """NVFP4 under a budget: the predicted bytes are the exported bytes, each attention block is NVFP4 or bf16 as a
    whole (SGLang's cascade), and the export's exclude_modules keep exactly the blocks chosen bf16."""
    run = NVFP4RunOptions(device="cpu", show_progress=False, budget="6bits", budget_windows=2, budget_seq_len=64)
    out = run_method(MODEL, tmp_path / "nvfp4", CALIB, SMALL, NVFP4Method(NVFP4LayerOptions(mse_iters=0), run), QUIET)
    report = json.loads((out / "quant_report.json").read_text())["budget"]
    assert report["predicted_bytes"] == report["achieved_bytes"] == _tensor_bytes(out)
    assert report["predicted_bytes"] <= report["budget_bytes"]
    with CheckpointReader(out) as reader:
        keys = set(reader.keys())
    choices = {u["unit"]: u["choice"] for u in report["units"]}
    assert set(choices.values()) == {"nvfp4", "bf16"}
    for unit in report["units"]:
        layer = unit["unit"].split(".")[2]
        for m in unit["members"]:
            packed = f"model.layers.{layer}.{m}.weight_scale" in keys
            assert packed == (unit["choice"] == "nvfp4"), (unit["unit"], m)
    attention = [u for u in report["units"] if u["unit"].endswith(".self_attn")]
    assert attention and all(len(u["members"]) >= 4 for u in attention)


def test_saved_choice_round_trips(tmp_path: Path) -> None:
    """A resumed run takes the choice its first run saved, and refuses one saved under other settings."""
    units = [Unit(0, "mlp.down_proj", ("mlp.down_proj",), ("4-bit", "8-bit", "bf16"), (10, 20, 40), 20)]
    options = SearchOptions(windows=2, seq_len=8)
    plan = BudgetPlan(Budget("25", bytes=25), 25, 5, 20, units, [[0.5, 0.1, 0.0]], [1], 2, 8, 1.0, options)
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(plan.report()))
    again = saved_choice(path, Budget("25", bytes=25), units, options)
    assert again is not None and again.choice == [1] and again.costs == [[0.5, 0.1, 0.0]]
    assert saved_choice(path, Budget("26", bytes=26), units, options) is None
    assert saved_choice(path, Budget("25", bytes=25), units, SearchOptions(windows=4, seq_len=8)) is None


def test_bad_budgets_fail_before_any_work(tmp_path: Path) -> None:
    """A budget below the all-4-bit export or holding the all-bf16 one, or combined with options that set bits,
    fails before the calibration data is read (it does not exist): no output and no work folder are left."""
    missing = [str(tmp_path / "absent.jsonl")]
    run = RunOptions(device="cpu", show_progress=False)

    def gptq(bits: BitsOptions) -> None:
        run_method(MODEL, tmp_path / "out", missing, SMALL, GPTQMethod(bits, GPTQLayerOptions(), run), QUIET)

    # the smallest: every group 4-bit but the minicpm4 q/k/v, which gptq_marlin cannot serve (bf16): 9,012,736 B
    with pytest.raises(BudgetError, match=r"below the smallest export .* 9\.01 MB \(4\.44 bits\)"):
        gptq(BitsOptions(budget="4bits"))
    with pytest.raises(BudgetError, match="nothing to quantize"):
        gptq(BitsOptions(budget="16bits"))
    with pytest.raises(PlanError, match="drop --minicpm4-bits"):
        gptq(BitsOptions(budget="5bits", minicpm4_bits=8))
    from salaquant.nvfp4.plan import NVFP4PlanError

    with pytest.raises(NVFP4PlanError, match="drop --dense-all"):
        run_method(
            MODEL,
            tmp_path / "o4",
            missing,
            SMALL,
            NVFP4Method(
                NVFP4LayerOptions(), NVFP4RunOptions(device="cpu", show_progress=False, budget="6bits", dense_all=True)
            ),
            QUIET,
        )
    from salaquant.outputs import work_dir_for

    for out in (tmp_path / "out", tmp_path / "o4"):
        assert not out.exists() and not work_dir_for(out).exists()
