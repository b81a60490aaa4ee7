"""The lm-evaluation-harness backend (``salaquant.eval.harness``) on the shipped model and its GPTQ and NVFP4 exports.

lm-eval runs three local tasks (``tests/lm_eval``: a YAML file and a small jsonl each, no download): multiple choice
(``loglikelihood``), greedy generation (``generate_until``) and word perplexity (``loglikelihood_rolling``). Their
expected scores are computed here outside the backend: from the model's own full forward, and for generation from
the runtime's ``Decoder`` on each prompt alone (the backend's decode path; its static-cache bf16 steps can part
from the model's eager ``greedy`` at a near tie of the tiny model's logits, which CPUs round differently).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import small_nvfp4_export

pytest.importorskip("lm_eval", reason="the lm-evaluation-harness is not installed (pip install -e '.[lm-eval]')")
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from salaquant.eval.harness import SalaquantLM
from salaquant.model.sampling import Sampling
from salaquant.runtime.decode import Decoder
from salaquant.runtime.load import load
from salaquant.workflow import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "sala-tiny"
TASKS = Path(__file__).resolve().parent / "lm_eval"


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference() -> SimpleNamespace:
    model = load(SHIPPED)
    return SimpleNamespace(model=model, tok=load_tokenizer(SHIPPED))


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t + 1] | ids[: t + 1]) for every t, from one full forward of the whole model over ``ids[:-1]`` (a
    bf16 model's logits move by rounding with the sequence's length, so the last token, which predicts nothing, is
    left out, as a scorer does)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    return F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _continuation_logprob(ref: SimpleNamespace, context: str, continuation: str) -> float:
    """lm-eval's split: the whole text's tokens, the context's first; the rest is the continuation."""
    whole = ref.tok.encode(context + continuation, add_special_tokens=False)
    n = len(ref.tok.encode(context, add_special_tokens=False))
    return float(_logprobs(ref.model, whole)[n - 1 :].sum())


def test_tasks_score_as_computed_independently(reference: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(TASKS)  # the YAML files name their jsonl relative to here
    out = simple_evaluate(
        model="salaquant",
        model_args={"pretrained": str(SHIPPED), "device": "cpu"},
        tasks=["salaquant_mc", "salaquant_gen", "salaquant_rolling"],
        batch_size=3,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    assert out is not None
    got = out["results"]

    mc = _docs("mc.jsonl")
    hits = []
    for d in mc:
        scores = [_continuation_logprob(reference, d["question"], " " + c) for c in d["choices"]]
        hits.append(max(range(len(scores)), key=scores.__getitem__) == d["label"])
    assert got["salaquant_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits))

    gen = _docs("gen.jsonl")
    matches = []
    decoder = Decoder(reference.model)  # the backend's decode path; each prompt alone (the backend batches 3)
    for d in gen:
        ids = reference.tok.encode(d["prompt"], add_special_tokens=False)
        (new,) = decoder.generate_in_batches([torch.tensor(ids)], 8, Sampling(0.0, 0, 1.0), batch_size=1)
        text = reference.tok.decode(new.tolist(), skip_special_tokens=True).split("\n")[0]
        matches.append(text == d["answer"])
    assert 0 < sum(matches) < len(matches)  # the shipped answers: some are the model's own continuation
    assert got["salaquant_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))

    total, words = 0.0, 0
    bos = reference.tok.bos_token_id
    for d in _docs("rolling.jsonl"):
        ids = [bos, *reference.tok.encode(d["text"], add_special_tokens=False)]
        total += float(_logprobs(reference.model, ids).sum())
        words += len(re.split(r"\s+", d["text"]))
    assert got["salaquant_rolling"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-3)


def _rolling_reference(ref: SimpleNamespace, text: str, window: int) -> float:
    """The rolling log-likelihood from its definition: the tokens (after BOS) predicted in chunks of ``window``,
    each chunk from the ``window`` tokens that end at its last input, the first from BOS alone."""
    seq = [ref.tok.bos_token_id, *ref.tok.encode(text, add_special_tokens=False)]
    total = 0.0
    for first in range(1, len(seq), window):
        end = min(first + window, len(seq))  # predicts seq[first:end]
        start = max(0, end - 1 - window)  # inputs seq[start:end - 1], at most `window` of them
        lp = _logprobs(ref.model, seq[start:end])
        total += float(lp[first - start - 1 :].sum())
    return total


def test_rolling_windows_and_batches(reference: SimpleNamespace) -> None:
    text = _docs("rolling.jsonl")[0]["text"]
    assert len(reference.tok.encode(text)) > 40  # several windows of 16
    lm = SalaquantLM(str(SHIPPED), device="cpu", max_length=16, batch_size=4)
    (got,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert got == pytest.approx(_rolling_reference(reference, text, 16), rel=2e-3)
    # right padding leaves each row's scores alone: in fp32 batched and single rows differ only by the products'
    # blocking (a pad token attended to, or one shifting a row, moves a score by far more than 1e-4 nats)
    batched_lm = SalaquantLM(str(SHIPPED), device="cpu", dtype="fp32", max_length=16, batch_size=4)
    one = SalaquantLM(str(SHIPPED), device="cpu", dtype="fp32", max_length=16, batch_size=1)
    pairs = [([1, 5, 9, 11, 20], [33, 7]), ([4], [8]), ([2, 3] * 5, [6, 6, 6])]
    batched, alone = batched_lm._score(pairs), one._score(pairs)
    for (b, bg), (a, ag) in zip(batched, alone, strict=True):
        assert b == pytest.approx(a, rel=0, abs=1e-4) and bg == ag


@pytest.fixture(scope="module")
def nvfp4_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_nvfp4_export(SHIPPED, tmp_path_factory.mktemp("nvfp4") / "out")


@pytest.mark.parametrize("fmt", ["gptq", "nvfp4"])
def test_quantized_export_scores_as_its_own_model(fmt: str, shipped_rtn_export: Path, nvfp4_export: Path) -> None:
    """The backend on a GPTQ export, and on an NVFP4 one run W4A4 (``activations=auto``), gives the loaded
    export's own full-forward log-likelihood; its own tokenizer by default."""
    path = shipped_rtn_export if fmt == "gptq" else nvfp4_export
    model = load(path, activations="fp4" if fmt == "nvfp4" else "bf16")
    ref = SimpleNamespace(model=model, tok=load_tokenizer(path))
    lm = SalaquantLM(str(path), device="cpu")
    ctx, cont = "The old man walked slowly down the", " road"
    ((ll, _),) = lm.loglikelihood([SimpleNamespace(args=(ctx, cont))], disable_tqdm=True)
    assert ll == pytest.approx(_continuation_logprob(ref, ctx, cont), rel=1e-2)


def test_command_line_registers_the_model(tmp_path: Path) -> None:
    """``salaquant-lm-eval`` is lm-eval's own command line with ``--model salaquant`` available; lm-eval's
    ``--device`` reaches the backend."""
    cmd = [str(Path(sys.executable).parent / "salaquant-lm-eval"), "run", "--model", "salaquant", "--device", "cpu"]
    cmd += ["--model_args", f"pretrained={SHIPPED}", "--tasks", "salaquant_mc"]
    cmd += ["--include_path", str(TASKS), "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=TASKS, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "salaquant_mc" in proc.stdout and "acc" in proc.stdout


def test_unknown_model_arg_fails_naming_it() -> None:
    """A misspelt ``--model_args`` key stops before loading, naming it; lm-eval's own settings that the backend
    does not take (``max_batch_size``) are left out rather than failing."""
    with pytest.raises(ValueError, match="kv_cach"):
        SalaquantLM.create_from_arg_string(f"pretrained={SHIPPED},kv_cach=fp8_e4m3")
    lm = SalaquantLM.create_from_arg_string(
        f"pretrained={SHIPPED}", {"batch_size": 2, "max_batch_size": 8, "device": "cpu"}
    )
    assert lm.batch_size == 2 and lm.device == torch.device("cpu")
