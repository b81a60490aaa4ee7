"""`salaquant eval`: the quantized model against its source, flags, per-layer error, gates and exit codes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from salaquant.calibration.calib_data import CalibOptions
from salaquant.cli import app
from salaquant.eval import EvalInputError, EvalOptions, Thresholds, run_eval
from salaquant.eval.data import SHIPPED_SAMPLE
from salaquant.eval.generation import collapse, find_loop, first_divergence, greedy, longest_run
from salaquant.eval.metrics import LogitComparison
from salaquant.eval.niah import FILLER, contains_value, effective_attention, make_case, needle_text, question_text
from salaquant.eval.options import parse_lengths
from salaquant.eval.thresholds import parse_fraction
from salaquant.model.loading import load_model
from salaquant.run_recipe import eval_gate
from salaquant.settings import EvalGate
from salaquant.workflow import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = str(ROOT / "calib" / "sala-tiny-calib.jsonl")
QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115
PROMPTS = ["It is a truth universally acknowledged, that", "In the beginning"]
runner = CliRunner()


def _opts(**kw) -> EvalOptions:
    base = {
        "max_len": 256,
        "windows": 2,
        "niah_lengths": [],
        "prompts": PROMPTS,
        "gen_tokens": 16,
        "layer_windows": 1,
        "device": "cpu",
        "show_progress": False,
    }
    return EvalOptions(**(base | kw))


def _copy_with(src: Path, dst: Path, edits: dict) -> Path:
    """A copy of a single-shard checkpoint with some tensors replaced by ``edit(tensor)``."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    for key, edit in edits.items():
        state[key] = edit(state[key])
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def export(shipped_rtn_export: Path) -> Path:
    return shipped_rtn_export


@pytest.fixture(scope="module")
def identity_export(export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source's weights under the export's quantization_config with one negative rule for every module (and no
    module listed to quantize): a GPTQ checkpoint in form (the checker passes it, with no quantized linear) that
    computes exactly what the source does."""
    out = tmp_path_factory.mktemp("eval") / "identity"
    shutil.copytree(MODEL, out)
    config = json.loads((out / "config.json").read_text())
    qc = json.loads((export / "config.json").read_text())["quantization_config"]
    config["quantization_config"] = {**qc, "dynamic": {"-:.*": {}}, "modules_in_block_to_quantize": []}
    (out / "config.json").write_text(json.dumps(config))
    return out


# ------------------------------------------------------------------------------------------------ end to end


def test_self_eval_is_exact(identity_export: Path, tmp_path: Path) -> None:
    gates = Thresholds(max_ppl_increase=0.0, max_kl=1e-6, min_top1=1.0, max_layer_error=0.0, no_collapse=True)
    r = run_eval(identity_export, MODEL, _opts(niah_lengths=[1100], niah_depths=(0.5,)), gates, tmp_path, QUIET)
    p = r["perplexity"]
    assert p["ppl_ratio"] == 1.0 and p["ppl_increase"] == 0.0
    assert abs(p["kl"]) < 1e-6 and p["kl_max"] < 1e-6
    assert p["top1"] == 1.0 and p["nll_diff"]["max"] == 0.0 and p["nll_diff"]["min"] == 0.0
    assert p["tokens"] == 2 * 255 and p["nonfinite_positions_quantized"] == 0
    assert r["stability"]["max_abs_logit_diff"] == 0.0
    assert all(g["first_divergence"] is None and not g["quantized"]["collapse"] for g in r["generation"]["prompts"])
    assert r["niah"]["source_rate"] == r["niah"]["quantized_rate"]
    assert r["niah"]["by_length"][0]["attention"] == "sparse"  # 1100 >= dense_len 1024
    assert all(e["rel_err"] == 0.0 for e in r["layers"]["layers"]) and r["layers"]["outliers"] == []
    assert r["passed"] and all(c["passed"] for c in r["thresholds"]) and len(r["thresholds"]) == 5
    assert r["quantized"]["check"]["status"] == "passed" and r["quantized"]["check"]["quantized_linears"] == 0
    # the source perplexity, recomputed independently with the plain loader on the same token windows
    tok = load_tokenizer(MODEL)
    ids: list[int] = []
    for line in SHIPPED_SAMPLE.read_text().splitlines()[:1]:
        ids += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    model, nll = load_model(MODEL), 0.0
    for w in range(2):
        win = torch.tensor(ids[w * 256 : (w + 1) * 256])[None]
        logits = model(win, attention_mode="auto").logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, win[0, 1:], reduction="sum"))
    assert abs(math.exp(nll / 510) / p["ppl_source"] - 1) < 1e-5
    # both files in place, strict JSON, a real PNG
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["perplexity"]["ppl_ratio"] == 1.0
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_generation_takes_the_first_built_in_prompts_decoded_together(export: Path, tmp_path: Path) -> None:
    """``gen_prompts`` picks the first built-in prompts; decoded as one batch, each prompt gets the tokens the
    model's own one-prompt ``generate`` gives it."""
    from salaquant.eval.generation import BUILTIN_PROMPTS

    opts = _opts(prompts=None, gen_prompts=3, gen_tokens=12, layer_windows=0, windows=1, max_len=64)
    r = run_eval(export, MODEL, opts, None, tmp_path, QUIET)
    rows = r["generation"]["prompts"]
    assert [g["prompt"] for g in rows] == list(BUILTIN_PROMPTS[:3])
    tok = load_tokenizer(MODEL)
    source = load_model(MODEL)
    for g in rows:
        ids = torch.tensor([tok(g["prompt"])["input_ids"]])
        alone = source.generate(ids, 12, eos_token_id=tok.eos_token_id)[0, ids.shape[1] :].tolist()
        assert g["source"]["tokens"] == alone
    for bad in (0, len(BUILTIN_PROMPTS) + 1):
        with pytest.raises(EvalInputError, match="--gen-prompts"):
            run_eval(export, MODEL, _opts(prompts=None, gen_prompts=bad), None, tmp_path / "x", QUIET)


def test_broken_layer_is_named(export: Path, tmp_path: Path) -> None:
    key = "model.layers.3.mlp.down_proj.scales"
    broken = _copy_with(export, tmp_path / "broken", {key: lambda t: t * 100})
    gates = Thresholds(max_ppl_increase=0.05)
    good = run_eval(export, MODEL, _opts(gen_tokens=0), None, tmp_path / "good", QUIET)["layers"]
    r = run_eval(broken, MODEL, _opts(gen_tokens=0), gates, tmp_path / "r", QUIET)
    layers = r["layers"]
    errs = [e["rel_err"] for e in layers["layers"]]
    assert layers["worst"]["layer"] == 3 and layers["worst"]["worst_branch"] == "mlp"
    assert layers["outliers"] == [3]
    assert errs[3] > 50 * max(errs[:3] + errs[4:])
    # only layer 3 changed: every other layer measures exactly what it does in the intact export
    assert [e["rel_err"] for e in good["layers"] if e["layer"] != 3] == errs[:3] + errs[4:]
    assert good["outliers"] == [] and good["worst"]["rel_err"] < 0.5
    assert any("layer 3 (lightning) stands out" in n and "mlp" in n for n in r["notes"])
    assert not r["passed"] and "ppl increase" in r["failures"][0]
    assert r["perplexity"]["ppl_increase"] > 0.05


def test_collapsed_model_is_flagged(export: Path, tmp_path: Path) -> None:
    """A zero final norm makes every logit 0: argmax is token 0, the tokenizer's <unk>, at every step."""
    dead = _copy_with(export, tmp_path / "dead", {"model.norm.weight": torch.zeros_like})
    r = run_eval(dead, MODEL, _opts(layer_windows=0), Thresholds(no_collapse=True), tmp_path / "r", QUIET)
    for g in r["generation"]["prompts"]:
        assert g["quantized"]["tokens"] == [0] * 16
        assert g["quantized"]["collapse"] == "unknown token 0 in 16 of 16 positions"
        assert g["source"]["collapse"] == "" and g["first_divergence"] == 0
    assert r["perplexity"]["unk_top1_fraction_quantized"] == 1.0
    assert r["perplexity"]["most_frequent_top1_quantized"] == {"token": 0, "fraction": 1.0}
    assert not r["passed"] and r["thresholds"][0]["name"] == "no_collapse"
    assert "collapses on prompt(s) [0, 1]" in r["failures"][0]


def test_nan_logits_are_flagged(export: Path, tmp_path: Path) -> None:
    """Finite weights whose activations overflow (a norm scaled to bf16's largest values) give NaN logits."""
    key = "model.layers.5.self_attn.o_norm.weight"
    bad = _copy_with(export, tmp_path / "nan", {key: lambda t: torch.full_like(t, 3e38)})
    r = run_eval(bad, MODEL, _opts(), Thresholds(max_kl=1.0, no_collapse=True), tmp_path / "r", QUIET)
    assert r["perplexity"]["nonfinite_positions_quantized"] == r["perplexity"]["tokens"] == 510
    assert r["perplexity"]["nonfinite_positions_source"] == 0
    assert all(g["quantized"]["nonfinite_step"] == 0 for g in r["generation"]["prompts"])
    assert all(g["source"]["nonfinite_step"] is None for g in r["generation"]["prompts"])
    assert 5 in r["layers"]["outliers"] and math.isnan(r["layers"]["layers"][5]["attention"])
    assert [c["passed"] for c in r["thresholds"]] == [False, False]  # a NaN KL fails its threshold
    saved = json.loads((tmp_path / "r" / "eval.json").read_text())  # strict JSON: NaN written as null
    assert saved["perplexity"]["kl"] is None and saved["perplexity"]["ppl_quantized"] is None


# ------------------------------------------------------------------------------------------------ CLI


def _cli(*args: str):
    return runner.invoke(app, ["eval", *args])


def test_cli_exit_codes(export: Path, tmp_path: Path) -> None:
    common = [str(export), "-r", str(MODEL), "--report", str(tmp_path), "--device", "cpu", "--max-len", "256"]
    common += ["--windows", "1", "--niah", "none", "--gen-tokens", "0", "--layer-windows", "1"]
    ok = _cli(*common, "--max-ppl-increase", "50%", "--max-kl", "1", "--min-top1", "0.5", "--max-layer-error", "1")
    assert ok.exit_code == 0, ok.output
    assert "PASS max_kl" in ok.output and (tmp_path / "eval.json").exists()
    miss = _cli(*common, "--max-kl", "0.000001", "--min-top1", "0.5")
    assert miss.exit_code == 3, miss.output
    assert "FAIL max_kl" in miss.output and "PASS min_top1" in miss.output
    assert not json.loads((tmp_path / "eval.json").read_text())["passed"]


def test_cli_bad_input(export: Path, tiny_ckpt: Path, tmp_path: Path) -> None:
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "Too short for a window."}) + "\n")
    cases = [
        ([str(tmp_path / "nope"), "-r", str(MODEL)], "nope"),
        ([str(llama), "-r", str(MODEL)], "model_type"),
        ([str(tiny_ckpt), "-r", str(MODEL)], "hidden_size"),  # a different model, not an export of the source
        ([str(export), "-r", str(MODEL), "--max-ppl-increase", "abc"], "--max-ppl-increase"),
        ([str(export), "-r", str(MODEL), "--max-ppl-increase", "5"], "5%"),
        ([str(export), "-r", str(MODEL), "--niah", "8q"], "--niah"),
        ([str(export), "-r", str(MODEL), "--niah", "16"], "too short"),
        ([str(export), "-r", str(MODEL), "--attention", "fast"], "--attention"),
        ([str(export), "-r", str(MODEL), "--data", str(tmp_path / "none.jsonl")], "none.jsonl"),
        ([str(export), "-r", str(MODEL), "--data", str(short)], "fewer than one window"),
        ([str(export), "-r", str(MODEL), "--max-len", "999999"], "--max-len 999999: longer than the model's 8192"),
        ([str(export), "-r", str(MODEL), "--gen-tokens", "0", "--no-new-loops"], "--no-new-loops"),
    ]
    for args, needle in cases:
        res = _cli(*args, "--device", "cpu", "--report", str(tmp_path / "rep"))
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output, (args, res.output)
    assert not (tmp_path / "rep" / "eval.json").exists()


def test_failed_format_check_stops_eval(export: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(export, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 100
    (bad / "config.json").write_text(json.dumps(cfg))
    res = _cli(str(bad), "-r", str(MODEL), "--device", "cpu", "--report", str(tmp_path / "rep"))
    assert res.exit_code == 1, res.output
    assert "format check failed" in res.output and "group" in res.output
    assert not (tmp_path / "rep" / "eval.json").exists()


def test_recipe_gate_uses_the_eval_metrics(export: Path) -> None:
    data = str(SHIPPED_SAMPLE)
    loose = eval_gate(MODEL, export, EvalGate(data=data, seq_len=128, windows=2, max_kl=1.0, min_top1=0.5), "cpu")
    assert loose["passed"] and loose["windows"] == 2 and 0 < loose["kl"] < 1.0
    assert loose["ppl_increase"] == pytest.approx(loose["ppl_quantized"] / loose["ppl_source"] - 1)
    tight = eval_gate(MODEL, export, EvalGate(data=data, seq_len=128, windows=2, max_kl=0.0), "cpu")
    assert not tight["passed"] and tight["failures"][0].startswith("KL")


# ------------------------------------------------------------------------------------------------ units


def test_logit_comparison_by_hand() -> None:
    """Vocabulary of 2: p = (1/2, 1/2), q = (3/4, 1/4); the target is token 1."""
    cmp = LogitComparison(unk_id=0)
    src = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    qnt = torch.tensor([[math.log(3.0), 0.0], [float("nan"), 0.0]])
    cmp.update(src[:1], qnt[:1], torch.tensor([1]))
    s = cmp.summary()
    assert s["kl"] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)  # 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25)
    assert s["nll_source"] == pytest.approx(math.log(2)) and s["nll_quantized"] == pytest.approx(math.log(4))
    assert s["ppl_source"] == pytest.approx(2.0) and s["ppl_quantized"] == pytest.approx(4.0)
    assert s["ppl_increase"] == pytest.approx(1.0) and s["nll_diff"]["mean"] == pytest.approx(math.log(2))
    assert s["top1"] == 1.0 and s["unk_top1_fraction_quantized"] == 1.0  # both pick token 0 (ties: first)
    cmp.update(src[1:], qnt[1:], torch.tensor([1]))
    s = cmp.summary()
    assert s["nonfinite_positions_quantized"] == 1 and s["nonfinite_positions_source"] == 0
    assert math.isnan(s["kl"]) and s["tokens"] == 2


def test_loop_detector_by_hand() -> None:
    assert find_loop(list(range(20))) is None
    assert find_loop([5] * 8).summary() == {"period": 1, "start": 0, "length": 8}
    assert find_loop([5] * 7) is None  # shorter than the 8-token minimum
    assert find_loop([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7]).summary() == {"period": 3, "start": 1, "length": 9}
    assert find_loop([1, 2, 3, 1, 2, 3, 1, 2]) is None  # 2.67 repeats of a 3-gram: fewer than 3
    assert find_loop([7, 8, 9, 4, 5, 4, 5, 4, 5, 4, 5]).summary() == {"period": 2, "start": 3, "length": 8}
    assert find_loop([1, 2, 1, 2, 1, 2], min_tokens=6).summary() == {"period": 2, "start": 0, "length": 6}
    assert find_loop([1, 2, 1, 2, 1, 2]) is None
    # "a man of a man , and" x 3: period 7, smallest period wins over 14
    seq = [3, 4, 10, 11, 12, 10, 11, 13, 14] * 1 + [10, 11, 12, 10, 11, 13, 14] * 2 + [99]
    assert find_loop(seq).summary() == {"period": 7, "start": 2, "length": 21}


def test_checked_greedy_equals_model_greedy() -> None:
    from salaquant.runtime.load import load

    model = load(MODEL)
    ids = torch.randint(3, 4096, (1, 40), generator=torch.Generator().manual_seed(5))
    for mode in ("dense", "sparse"):
        g = greedy(model, ids, 10, mode)
        assert g.tokens == model.greedy(ids, 10, attention_mode=mode)[0, 40:].tolist() and g.nonfinite_step is None
    eos = g.tokens[3]
    stopped = greedy(model, ids, 10, "sparse", eos_id=eos)
    assert stopped.tokens == g.tokens[: g.tokens.index(eos) + 1]  # stops after EOS, which is kept


def test_token_shares_by_hand() -> None:
    from salaquant.eval.generation import token_shares

    got = token_shares([5, 0, 0, 0, 7, 3, 0, 3], unk_id=3)
    assert got == {"top_token": 0, "top_share": 0.5, "unk_share": 0.25, "token0_share": 0.5, "longest_run": 3}
    assert token_shares([], None)["top_share"] == 0.0 and token_shares([4], None)["unk_share"] == 0.0


def test_collapse_and_divergence_by_hand() -> None:
    assert collapse([3] * 16, unk_id=0) == "token 3 repeated 16 times"
    assert collapse([3] * 15 + [4], unk_id=0) == ""  # a run of 15 < 16
    assert collapse([4, 4, 4, 4], unk_id=None) == "token 4 repeated 4 times"  # shorter than 16: all of it
    assert collapse([0, 5, 0, 6, 0, 7, 8, 9], unk_id=0) == "unknown token 0 in 3 of 8 positions"
    assert collapse([0, 5, 6, 7, 8, 9, 10, 11], unk_id=0) == ""
    assert collapse([0, 5, 0, 6, 0, 7, 8, 9], unk_id=None) == ""
    assert collapse([], unk_id=0) == ""
    assert longest_run([1, 2, 2, 3, 3, 3, 2]) == (3, 3)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_niah_needle_placement() -> None:
    tok = load_tokenizer(MODEL)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    longest = max(len(enc(" " + s)) for s in FILLER)
    starts = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        c = make_case(tok, 600, depth, seed=3, bos_id=1)
        needle, question = enc(needle_text(c.key, c.value)), enc(question_text(c.key))
        assert c.ids.numel() == 600 and int(c.ids[0]) == 1
        assert c.ids[c.needle_start : c.needle_end].tolist() == needle
        assert c.ids[-len(question) :].tolist() == question
        filler = 600 - 1 - len(needle) - len(question)
        # the needle starts at a sentence boundary of the filler, the one nearest depth x filler tokens
        assert abs((c.needle_start - 1) - depth * filler) <= longest, (depth, c.needle_start, filler)
        assert len(c.value) == 5 and c.value.isdigit()
        starts.append(c.needle_start)
    assert starts[0] == 1  # depth 0: right after BOS
    assert starts == sorted(starts) and len(set(starts)) == 5
    again = make_case(tok, 600, 0.5, seed=3, bos_id=1)
    assert torch.equal(again.ids, make_case(tok, 600, 0.5, seed=3, bos_id=1).ids)
    assert not torch.equal(again.ids, make_case(tok, 600, 0.5, seed=4, bos_id=1).ids)
    with pytest.raises(ValueError, match="too short"):
        make_case(tok, 20, 0.5, seed=0, bos_id=1)


def test_niah_scoring_and_lengths() -> None:
    assert contains_value("The secret code is 12345.", "12345")
    assert contains_value("12345", "12345")
    assert not contains_value("123456", "12345")
    assert not contains_value("012345", "12345")
    assert not contains_value("1234 5", "12345")
    assert effective_attention("auto", 1024, 1024) == "sparse"
    assert effective_attention("auto", 1023, 1024) == "dense"
    assert effective_attention("dense", 50000, 1024) == "dense"
    assert effective_attention("auto", 50000, None) == "dense"
    assert parse_lengths("8k,32k") == [8192, 32768] and parse_lengths("1100") == [1100]
    assert parse_lengths("auto") is None and parse_lengths("none") == []


def test_threshold_parsing_and_checks() -> None:
    assert parse_fraction("5%", "x") == pytest.approx(0.05) and parse_fraction("0.05", "x") == 0.05
    assert parse_fraction("150%", "x") == pytest.approx(1.5)
    for bad in ("5", "abc", "-1%", "nan"):
        with pytest.raises(ValueError):
            parse_fraction(bad, "--max-ppl-increase")
    gate = Thresholds(max_ppl_increase=0.05, max_kl=0.1, min_top1=0.9)

    def verdicts(inc: float, kl: float, top1: float) -> list[bool]:
        return [c["passed"] for c in gate.check({"perplexity": {"ppl_increase": inc, "kl": kl, "top1": top1}})]

    assert verdicts(0.05, 0.1, 0.9) == [True, True, True]  # limits are inclusive
    assert verdicts(0.0501, 0.1001, 0.8999) == [False, False, False]
    assert verdicts(math.nan, math.nan, math.nan) == [False, False, False]
    assert [c["passed"] for c in Thresholds(max_layer_error=0.1).check({})] == [False]  # not measured


def test_nvfp4_evaluated_w4a4_by_default(export: Path, tmp_path: Path) -> None:
    """An NVFP4 export is scored as Blackwell runs it (FP4 activations) unless asked for weight-only; the FP4
    activations add error on top of the weights'. A GPTQ export is weight-only and refuses fp4."""
    from salaquant.driver import run_method
    from salaquant.nvfp4.command import NVFP4Method, NVFP4RunOptions
    from salaquant.nvfp4.layer import NVFP4LayerOptions

    nvfp4 = run_method(
        MODEL,
        tmp_path / "nvfp4",
        [CALIB],
        CalibOptions(max_samples=2, max_len=128),
        NVFP4Method(NVFP4LayerOptions(mse_iters=0), NVFP4RunOptions(device="cpu", show_progress=False)),
        QUIET,
    )
    fast = {"gen_tokens": 0, "layer_windows": 0}
    w4a4 = run_eval(nvfp4, MODEL, _opts(**fast), Thresholds(), tmp_path / "a", QUIET)
    w4a16 = run_eval(nvfp4, MODEL, _opts(activations="bf16", **fast), Thresholds(), tmp_path / "b", QUIET)
    assert w4a4["quantized"]["activations"] == "fp4" and w4a16["quantized"]["activations"] == "bf16"
    assert w4a4["perplexity"]["ppl_source"] == w4a16["perplexity"]["ppl_source"]
    assert w4a4["perplexity"]["kl"] > w4a16["perplexity"]["kl"] > 0
    gate = {"data": str(SHIPPED_SAMPLE), "seq_len": 128, "windows": 2}
    gate_fp4, gate_bf16 = (
        eval_gate(MODEL, nvfp4, EvalGate(**gate)),
        eval_gate(MODEL, nvfp4, EvalGate(**gate, activations="bf16")),
    )
    assert gate_fp4["activations"] == "fp4" and gate_bf16["activations"] == "bf16"  # a recipe's eval gate alike
    assert gate_fp4["kl"] > gate_bf16["kl"] > 0
    assert eval_gate(MODEL, export, EvalGate(**gate))["activations"] == "bf16"
    with pytest.raises(EvalInputError, match="weight-only"):
        run_eval(export, MODEL, _opts(activations="fp4", **fast), Thresholds(), tmp_path / "c", QUIET)
    with pytest.raises(EvalInputError, match="--activations"):
        run_eval(export, MODEL, _opts(activations="int8", **fast), Thresholds(), tmp_path / "d", QUIET)


def test_repeated_sampled_runs_report_their_spread(identity_export: Path, tmp_path: Path) -> None:
    """``repeat`` runs NIAH and generation again with new sampling seeds: identical models draw identically in
    each run, the first run is what a single run with the same seed gives, and the spread is each measure's."""
    kw = {"niah_lengths": [300], "niah_depths": (0.5,), "layer_windows": 0, "windows": 1, "temperature": 1.0}
    r = run_eval(identity_export, MODEL, _opts(repeat=3, **kw), None, tmp_path / "a", QUIET)
    once = run_eval(identity_export, MODEL, _opts(**kw), None, tmp_path / "b", QUIET)
    runs = r["repeats"]["runs"]
    assert len(runs) == 3 and r["repeats"]["temperature"] == 1.0
    for run in runs:
        assert run["niah_source_rate"] == run["niah_quantized_rate"] and run["identical"] == len(PROMPTS)
    assert r["generation"] == once["generation"] and "repeats" not in once
    texts = {g["quantized"]["text"] for g in r["generation"]["prompts"]}
    assert len(texts) == len(PROMPTS)
    for name, sp in r["repeats"]["spread"].items():
        xs = [run[name] for run in runs]
        assert sp["min"] == min(xs) and sp["max"] == max(xs) and sp["mean"] == pytest.approx(sum(xs) / 3)
    from salaquant.eval.command import _draw
    from salaquant.eval.generation import continue_batch

    model, ids = load_model(MODEL), [torch.arange(5, 30)]
    draws = [continue_batch(model, ids, 24, "auto", None, *_draw(_opts(**kw), run))[0].tokens for run in range(3)]
    assert len({tuple(d) for d in draws}) == 3  # each run draws other tokens
    assert draws[1] == continue_batch(model, ids, 24, "auto", None, *_draw(_opts(**kw), 1))[0].tokens
    with pytest.raises(EvalInputError, match="--repeat 2 needs --temperature"):
        run_eval(identity_export, MODEL, _opts(repeat=2), None, tmp_path / "c", QUIET)
