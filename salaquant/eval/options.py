"""What ``salaquant eval`` measures and how (`EvalOptions`, validated before any work), its length and depth
flags, and `EvalInputError` for bad input."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.config import ATTENTION_MODES
from ..model.kv_cache_dtype import KV_CACHE_DTYPES
from ..runtime.load import ACTIVATIONS
from . import generation as gen
from . import tasks as tk

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class EvalInputError(ValueError):
    """Bad input to eval (path, config, option, data): nothing was loaded or run."""


@dataclass
class EvalOptions:
    """What to measure and how. ``niah_lengths=None`` means "auto": dense_len and 4 x dense_len (none when the
    checkpoint has no sparse_config); an empty list skips NIAH; ``gen_tokens=0`` skips generation and
    ``layer_windows=0`` the per-layer error."""

    data: str | None = None
    field: str | None = None
    max_len: int = 4096
    windows: int = 8
    attention: str = "auto"
    niah_lengths: list[int] | None = None
    niah_depths: tuple[float, ...] = DEFAULT_DEPTHS
    prompts: list[str] | None = None  # None: the built-in prompt set
    prompts_file: str | None = None
    gen_prompts: int = gen.DEFAULT_GEN_PROMPTS  # how many built-in prompts (without prompts / prompts_file)
    tasks: list[str] = dataclasses.field(default_factory=list)  # long-context tasks (``tasks.TASKS``); none by default
    task_lengths: list[int] | None = None  # None: the NIAH default lengths
    task_samples: int = 2  # cases per task and length
    temperature: float = 0.0  # NIAH, tasks and generation: 0 greedy, else sampled
    repeat: int = 1  # runs of NIAH, tasks and generation with different sampling seeds (needs temperature > 0)
    kv_cache: str = "bf16"  # the export's minicpm4 KV cache as served (``model.kv_cache_dtype``); the source's stays
    gen_tokens: int = 40
    layer_windows: int = 2
    device: str = "auto"
    backend: str = "auto"
    kernels: bool | None = None  # None: the runtime's default
    activations: str = "auto"  # "auto": FP4 for NVFP4 exports (W4A4, as Blackwell runs them), else 16-bit
    dtype: str = "bf16"
    tp: int = 1
    seed: int = 0
    show_progress: bool = True

    def validate(self) -> None:
        if self.activations not in ("auto", *ACTIVATIONS):
            raise EvalInputError(f"--activations {self.activations!r}: expected auto, {' or '.join(ACTIVATIONS)}")
        if self.attention not in ATTENTION_MODES:
            raise EvalInputError(f"--attention {self.attention!r}: expected one of {', '.join(ATTENTION_MODES)}")
        if self.max_len < 2:
            raise EvalInputError(f"--max-len {self.max_len}: need at least 2 tokens per window")
        if self.windows < 1:
            raise EvalInputError(f"--windows {self.windows}: need at least one window")
        if not 1 <= self.gen_prompts <= len(gen.BUILTIN_PROMPTS):
            raise EvalInputError(f"--gen-prompts {self.gen_prompts}: between 1 and {len(gen.BUILTIN_PROMPTS)}")
        if self.gen_tokens < 0 or 0 < self.gen_tokens < 8:
            raise EvalInputError(f"--gen-tokens {self.gen_tokens}: 0 (skip generation) or at least 8")
        if self.layer_windows < 0:
            raise EvalInputError(f"--layer-windows {self.layer_windows}: must be >= 0")
        if self.tp < 1:
            raise EvalInputError(f"--tp {self.tp}: must be >= 1")
        for d in self.niah_depths:
            if not 0.0 <= d <= 1.0:
                raise EvalInputError(f"--niah-depths: {d} is not a fraction between 0 and 1")
        if self.niah_lengths is not None and any(n < 2 for n in self.niah_lengths):
            raise EvalInputError(f"--niah: lengths must be at least 2 tokens, got {self.niah_lengths}")
        unknown = [t for t in self.tasks if t not in tk.TASKS]
        if unknown:
            raise EvalInputError(f"--tasks: unknown task {unknown[0]!r}; expected {', '.join(tk.TASKS)} (or niah)")
        if not self.temperature >= 0:
            raise EvalInputError(f"--temperature {self.temperature}: must be >= 0")
        if self.repeat < 1:
            raise EvalInputError(f"--repeat {self.repeat}: must be >= 1")
        if self.repeat > 1 and self.temperature == 0:
            raise EvalInputError(f"--repeat {self.repeat} needs --temperature > 0 (greedy runs are all the same)")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise EvalInputError(f"--kv-cache {self.kv_cache!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.task_samples < 1:
            raise EvalInputError(f"--task-samples {self.task_samples}: must be >= 1")
        if self.task_lengths is not None and any(n < 2 for n in self.task_lengths):
            raise EvalInputError(f"--lengths: lengths must be at least 2 tokens, got {self.task_lengths}")
        if self.prompts is not None and any(not p for p in self.prompts):
            raise EvalInputError("--prompts: empty prompt")


def parse_lengths(text: str, flag: str = "--niah") -> list[int] | None:
    """``"8k,32k"`` -> [8192, 32768]; ``"auto"`` -> None; ``"none"`` / ``""`` -> []."""
    t = text.strip().lower()
    if t == "auto":
        return None
    if t in ("", "none", "off", "0"):
        return []
    out = []
    for part in t.split(","):
        p = part.strip()
        mult = 1024 if p.endswith("k") else 1024 * 1024 if p.endswith("m") else 1
        num = p[:-1] if mult > 1 else p
        try:
            value = float(num) * mult
        except ValueError:
            raise EvalInputError(f"{flag} {text!r}: {part!r} is not a length such as 8k, 32k or 4096") from None
        if value != int(value) or value < 2:
            raise EvalInputError(f"{flag} {text!r}: {part!r} is not a whole number of tokens >= 2")
        out.append(int(value))
    return out


def parse_depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise EvalInputError(f"--niah-depths {text!r}: expected fractions such as 0.1,0.5,0.9") from None
    if not depths:
        raise EvalInputError("--niah-depths: no depth given")
    return depths
