"""Held-out text for eval, as one token stream: each record's tokens (no BOS) followed by the EOS token.

That is the layout the shipped model was trained and scored on (``salaquant.eval.perplexity.encode_stream``), so
eval's source perplexity on the shipped model's held-out text equals the figure in the README. Sources are
read by ``salaquant.calibration.calib_data.load_calibration``: JSON Lines, text files, folders, parquet and
``hf:NAME[:CONFIG][@SPLIT][#FIELD]`` datasets. Without a source, the shipped sample is used: the first nine
documents (40,522 tokens) of the held-out split of ``models/sala-tiny``, public-domain English prose never
used for training or calibration (sources and licences in ``calib/LICENSE-DATA.md``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..calibration.calib_data import CalibOptions, load_calibration

SHIPPED_SAMPLE = Path(__file__).with_name("heldout_sample.jsonl")


@dataclass
class EvalText:
    """The token stream and where it came from."""

    tokens: torch.Tensor  # 1-D int64
    source: str
    records: int

    def summary(self) -> dict[str, Any]:
        return {"source": self.source, "records": self.records, "tokens": int(self.tokens.numel())}


def load_eval_text(data: str | None, tokenizer: Any, eos_id: int | None, field: str | None = None) -> EvalText:
    """Tokenize ``data`` (or the shipped sample) into one stream; raises ``CalibrationError`` on bad input."""
    source = data if data is not None else str(SHIPPED_SAMPLE)
    texts = load_calibration([source], tokenizer, CalibOptions(max_len=sys.maxsize, field=field, bos=False))
    ids: list[int] = []
    for sample in texts.samples:
        ids.extend(sample.ids.tolist())
        if eos_id is not None:
            ids.append(int(eos_id))
    label = source if data is not None else f"shipped sample ({SHIPPED_SAMPLE.name})"
    return EvalText(torch.tensor(ids, dtype=torch.long), label, len(texts.samples))
