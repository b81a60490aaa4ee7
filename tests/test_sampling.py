"""Next-token choice (``salaquant.model.sampling``) and the model's ``generate``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from salaquant.model.loading import load_model
from salaquant.model.sampling import Sampling, filter_logits, next_token


def _kept(logits: list[float], **kw: float) -> list[int]:
    out = filter_logits(torch.tensor([logits]), **kw)  # type: ignore[arg-type]
    return torch.isfinite(out[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_largest() -> None:
    assert _kept([1.0, 3.0, 2.0, 0.0], top_k=2) == [1, 2]
    assert _kept([1.0, 3.0, 2.0, 0.0], top_k=0) == [0, 1, 2, 3]  # 0: no cut
    assert _kept([1.0, 3.0, 2.0, 0.0], top_k=9) == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 (in shuffled positions); mass ranked above each: 0, 0.5, 0.8, 0.95
    logits = [math.log(p) for p in (0.15, 0.5, 0.05, 0.3)]
    assert _kept(logits, top_p=0.7) == [1, 3]  # 0.5 < 0.7 keeps the second; 0.8 >= 0.7 drops the third
    assert _kept(logits, top_p=0.5) == [1]  # the mass above the second is already 0.5
    assert _kept(logits, top_p=0.81) == [0, 1, 3]
    assert _kept(logits, top_p=0.01) == [1]  # the most likely token always stays
    assert _kept(logits, top_p=0.7, top_k=1) == [1]


def test_sampled_frequencies_follow_the_tempered_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampling = Sampling(temperature=2.0)
    gen = torch.Generator().manual_seed(torch.initial_seed())
    n = 20000
    draws = torch.cat([next_token(logits.expand(1000, 4), sampling, gen) for _ in range(n // 1000)])
    freq = torch.bincount(draws.flatten(), minlength=4).double() / n
    weights = [math.exp(x / 2.0) for x in (2.0, 1.0, 0.0, -1.0)]
    want = [w / sum(weights) for w in weights]  # 0.455, 0.276, 0.167, 0.102
    for got, p in zip(freq.tolist(), want, strict=True):
        assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / n), (freq.tolist(), want)
    # cut to the top 2 and renormalised: exp(1) : exp(0.5)
    cut = torch.cat([next_token(logits.expand(1000, 4), Sampling(2.0, top_k=2), gen) for _ in range(n // 1000)])
    share = float((cut == 0).double().mean())
    p0 = math.exp(1.0) / (math.exp(1.0) + math.exp(0.5))
    assert set(cut.flatten().tolist()) == {0, 1} and abs(share - p0) < 5 * math.sqrt(p0 * (1 - p0) / n)


def test_greedy_and_invalid_settings() -> None:
    logits = torch.tensor([[0.1, 0.7, 0.2], [3.0, -1.0, 2.9]])
    assert next_token(logits, Sampling()).flatten().tolist() == [1, 0]
    assert next_token(logits, Sampling(temperature=5.0, top_k=1)).flatten().tolist() == [1, 0]
    for bad in ({"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            Sampling(**bad)  # type: ignore[arg-type]


def test_generate(tiny_ckpt: Path) -> None:
    model = load_model(tiny_ckpt)
    ids = torch.randint(3, 264, (2, 12), generator=torch.Generator().manual_seed(3))  # tiny vocabulary: 264
    greedy = model.greedy(ids, 10)
    assert greedy.shape == (2, 22) and torch.equal(greedy[:, :12], ids)
    # each greedy token is the argmax of a full forward over what came before it
    assert torch.equal(greedy[:, 12:], model(greedy[:, :-1]).logits[:, 11:].argmax(-1))
    hot = Sampling(temperature=1.5)
    a = model.generate(ids, 10, hot, generator=torch.Generator().manual_seed(7))
    b = model.generate(ids, 10, hot, generator=torch.Generator().manual_seed(7))
    c = model.generate(ids, 10, hot, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # early stop: the first greedy token of row 0 as EOS; row 1 goes on until it emits it too (or the limit)
    eos = int(greedy[0, 12])
    stopped = model.generate(ids, 10, eos_token_id=eos)
    assert stopped[0, 12] == eos and (stopped[0, 12:] == eos).all()
    row1 = greedy[1, 12:].tolist()
    end = row1.index(eos) + 1 if eos in row1 else 10
    assert stopped.shape[1] == 12 + end and stopped[1, 12:].tolist() == row1[:end]
