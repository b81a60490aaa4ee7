"""The synthetic long-context tasks (``salaquant.eval.tasks``): scoring by hand, and every generated case checked
against what its own prompt text says (counted or followed independently of the generator)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from salaquant.eval.tasks import TASKS, make_task_case, score
from salaquant.workflow import load_tokenizer

MODEL = Path(__file__).resolve().parents[1] / "models" / "sala-tiny"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def test_score_by_hand() -> None:
    assert score("The codes are 12345, 67890.", ["12345", "67890"]) == 1.0
    assert score("nothing here", ["12345"]) == 0.0
    assert score("first 11111 and then 33333", ["11111", "22222", "33333", "44444"]) == 0.5
    assert score("VAR ABCD and abcd", ["ABCD"]) == 1.0  # case-insensitive
    assert score("123456", ["12345"]) == 0.0  # whole words only
    assert score("kotunis", ["kotuni"]) == 0.0
    with pytest.raises(ValueError, match="reference"):
        score("x", [])


def _text(tok, case) -> str:
    return tok.decode(case.ids, skip_special_tokens=True)


@pytest.mark.parametrize("length", [1024, 3000])
@pytest.mark.parametrize("task", TASKS)
def test_cases_are_deterministic_and_fit(tok, task: str, length: int) -> None:
    a = make_task_case(tok, task, length, 2, 7, tok.bos_token_id)
    b = make_task_case(tok, task, length, 2, 7, tok.bos_token_id)
    c = make_task_case(tok, task, length, 3, 7, tok.bos_token_id)
    assert a.ids.tolist() == b.ids.tolist() and a.answers == b.answers
    assert a.ids.tolist() != c.ids.tolist()
    assert 0.8 * length <= a.ids.numel() <= length and int(a.ids[0]) == tok.bos_token_id
    assert a.max_new_tokens > len(tok(" " + ", ".join(a.answers), add_special_tokens=False)["input_ids"])
    assert score(", ".join(a.answers), a.answers) == 1.0


def test_niah_variants_hold_their_needles(tok) -> None:
    mk = make_task_case(tok, "niah_multikey", 2048, 0, 1, tok.bos_token_id)
    needles = re.findall(r"The secret code for (\w+) is (\d+)\.", _text(tok, mk))
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = re.search(r"What is the secret code for (\w+)\?", _text(tok, mk)).group(1)
    assert mk.answers == [dict(needles)[asked]]
    mv = make_task_case(tok, "niah_multivalue", 2048, 0, 1, tok.bos_token_id)
    found = re.findall(r"One of the secret codes for (\w+) is (\d+)\.", _text(tok, mv))
    assert len(found) == 4 and len({k for k, _ in found}) == 1 and sorted(v for _, v in found) == sorted(mv.answers)
    assert re.search(rf"What are all the secret codes for {found[0][0]}\?", _text(tok, mv))


def test_variable_tracking_answers_follow_the_chain(tok) -> None:
    case = make_task_case(tok, "vt", 2048, 0, 1, tok.bos_token_id)
    text = _text(tok, case)
    assigned = dict(re.findall(r"VAR (\w+) = (\w+)\.", text))
    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
    holders = {v for v, x in assigned.items() if x == value}
    grown = True
    while grown:  # every variable assigned from one that holds the value holds it too
        new = {v for v, x in assigned.items() if x in holders} - holders
        holders |= new
        grown = bool(new)
    assert holders == set(case.answers) and len(holders) == 5


def test_common_and_frequent_words_are_the_counted_ones(tok) -> None:
    cwe = make_task_case(tok, "cwe", 4096, 0, 1, tok.bos_token_id)
    listed = re.findall(r"\d+\. (\w+)", _text(tok, cwe))
    counts = Counter(listed).most_common()
    assert {w for w, _ in counts[:10]} == set(cwe.answers) and counts[9][1] > counts[10][1]
    fwe = make_task_case(tok, "fwe", 4096, 0, 1, tok.bos_token_id)
    coded = _text(tok, fwe).split("coded word.")[1].split(" Question:")[0].split()
    top = Counter(coded).most_common(4)
    assert [w for w, _ in top[:3]] == fwe.answers and top[0][1] > top[1][1] > top[2][1] > top[3][1]


def test_bad_requests_are_refused(tok) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_task_case(tok, "qa", 1024, 0, 0)
    with pytest.raises(ValueError, match="too short"):
        make_task_case(tok, "cwe", 200, 0, 0)
    with pytest.raises(ValueError, match="too short"):
        make_task_case(tok, "niah_multikey", 40, 0, 0)


# ------------------------------------------------------------------------------------------------ in the eval


def test_eval_runs_the_tasks_on_identical_prompts(tmp_path: Path) -> None:
    """The source against an export that computes exactly what the source does: every task case gets the same
    continuation and score on both sides, rows per task and length, the drop gate passes and the report shows a
    panel per task; a gate on a task not run is refused."""
    import json
    import shutil

    from rich.console import Console

    from salaquant.eval import EvalInputError, EvalOptions, Thresholds, run_eval
    from salaquant.model.tiny import preset_config, write_random_checkpoint

    src = write_random_checkpoint(tmp_path / "src", preset_config("tiny", vocab_size=4096), seed=3, std=0.05)
    for f in MODEL.glob("*token*"):
        shutil.copy(f, src / f.name)
    same = tmp_path / "same"
    shutil.copytree(src, same)
    config = json.loads((same / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                     "sym": True, "dynamic": {"-:.*": {}}}  # fmt: skip
    (same / "config.json").write_text(json.dumps(config))
    opts = EvalOptions(
        max_len=64,
        windows=1,
        niah_lengths=[],
        gen_tokens=0,
        layer_windows=0,
        device="cpu",
        show_progress=False,
        tasks=["niah_multikey", "cwe"],
        task_lengths=[1024, 1400],
        task_samples=2,
    )
    quiet = Console(quiet=True)
    gates = Thresholds(max_task_drop={"cwe": 0.0, "niah_multikey": 0.0})
    r = run_eval(same, src, opts, gates, tmp_path / "report", quiet)
    tasks = r["tasks"]
    assert [(row["task"], row["length"]) for row in tasks["by_task"]] == [
        ("niah_multikey", 1024), ("niah_multikey", 1400), ("cwe", 1024), ("cwe", 1400)]  # fmt: skip
    assert len(tasks["cases"]) == 8 and all(row["drop"] == 0.0 for row in tasks["by_task"])
    for case in tasks["cases"]:
        assert case["source"]["text"] == case["quantized"]["text"]
        assert case["source"]["score"] == case["quantized"]["score"] == score(case["source"]["text"], case["answers"])
    assert {c["attention"] for c in tasks["cases"]} == {"sparse"}  # both lengths past dense_len (256)
    assert [g["name"] for g in r["thresholds"]] == ["max_drop[cwe]", "max_drop[niah_multikey]"] and r["passed"]
    assert (tmp_path / "report" / "eval.png").stat().st_size > 0
    with pytest.raises(EvalInputError, match="--max-drop vt"):
        run_eval(same, src, opts, Thresholds(max_task_drop={"vt": 0.1}), tmp_path / "r2", quiet)
    with pytest.raises(EvalInputError, match="--tasks: unknown task 'qa'"):
        run_eval(same, src, EvalOptions(tasks=["qa"], device="cpu", show_progress=False), None, tmp_path / "r3", quiet)


def test_task_drop_gate_and_flags_by_hand() -> None:
    from salaquant.eval import Thresholds
    from salaquant.eval.tasks import parse_tasks
    from salaquant.eval.thresholds import parse_task_drops

    result = {"tasks": {"by_task": [
        {"task": "cwe", "length": 4096, "cases": 2, "source": 0.9, "quantized": 0.6},
        {"task": "cwe", "length": 32768, "cases": 2, "source": 0.5, "quantized": 0.5},
    ]}}  # fmt: skip
    (gate,) = Thresholds(max_task_drop={"cwe": 0.1}).check(result)
    assert not gate["passed"] and gate["value"] == pytest.approx(0.15)  # (0.9 + 0.5) / 2 - (0.6 + 0.5) / 2
    (gate,) = Thresholds(max_task_drop={"cwe": 0.2}).check(result)
    assert gate["passed"]
    (gate,) = Thresholds(max_task_drop={"fwe": 0.2}).check(result)
    assert not gate["passed"] and "not measured" in gate["message"]
    assert parse_task_drops("cwe=5%, vt=0.1", TASKS) == {"cwe": 0.05, "vt": 0.1}
    for bad in ("cwe", "qa=5%", "cwe=lots", ""):
        with pytest.raises(ValueError, match="--max-drop"):
            parse_task_drops(bad, TASKS)
    assert parse_tasks("niah, cwe,niah_multikey") == ["niah_multikey", "niah_multivalue", "cwe"]
    assert parse_tasks("none") == []
