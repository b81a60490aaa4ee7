"""Batched generation on a static cache; on CUDA each decode step replays a captured CUDA graph.

``Decoder(model).generate(prompts, ...)`` continues a batch of prompts of different lengths:

1. **prefill**: prompts of equal length run together (``PREFILL_TOKENS`` at a time) through the model with a
   `SalaCache` (the same code as ``SalaForCausalLM.generate``), and their state is copied into the rows of one
   `StaticCache` sized for the longest prompt plus the new tokens;
2. **decode**: one token per row per step, every row at its own position (``static_cache.decode_attention``);
   sampling (greedy or ``Sampling``) runs on the step's fp32 logits, outside the graph.

On CUDA the step is captured once per batch bucket (1, 2, 4, 8, 16, 32, 64, then multiples of 64; unused rows
decode a dummy token and are dropped) and cache capacity, after a warm-up run that compiles and tunes the
kernels on a scratch state; a later call that fits reuses the graph. With ``compile`` the captured step is
``torch.compile``'s version of it (``step_fn``), compiled during that warm-up. ``graphs=False`` (and every CPU run)
takes the same step eagerly. Each row stops at ``eos_token_id`` (kept; padded with it until every row has stopped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import progress
from ..model.cache import SalaCache
from ..model.modeling import NonFiniteLogits, SalaForCausalLM, lm_logits
from ..model.sampling import Sampling, next_token
from ..model.static_cache import StaticCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = 32768
"""Prompts of one length are prefilled together up to this many tokens per forward (at least one prompt)."""
EOS_CHECK_EVERY = 16
"""Steps between checks that every row has stopped (each check waits for the GPU)."""


def bucket(batch: int) -> int:
    """The batch size a graph is captured for: the smallest bucket holding ``batch``."""
    for b in BUCKETS:
        if batch <= b:
            return b
    return -(-batch // BUCKETS[-1]) * BUCKETS[-1]


@dataclass
class Timings:
    """Wall seconds of the last ``generate``: prefill (to the first token), capture (warm-up + graph capture, 0
    when a graph was reused or none is used), decode (the remaining tokens), and how many decode steps ran."""

    prefill: float = 0.0
    capture: float = 0.0
    decode: float = 0.0
    steps: int = 0


@dataclass
class Continuation:
    """A prompt's new tokens and the first step whose logits were NaN/Inf (0: the prefill; None: none)."""

    tokens: torch.Tensor
    nonfinite_step: int | None


@dataclass
class _Graph:
    cache: StaticCache
    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class Decoder:
    model: SalaForCausalLM
    graphs: bool = True
    compile: bool = False
    attention_mode: str | None = None
    timings: Timings = field(default_factory=Timings)
    _captured: dict[tuple[int, str], _Graph] = field(default_factory=dict)
    _compiled: Callable[[torch.Tensor, StaticCache], torch.Tensor] | None = None

    def _device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def _dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def _use_graphs(self) -> bool:
        return self.graphs and self._device().type == "cuda"

    def _logits(self, tokens: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        out = self.model(tokens, cache=cache, attention_mode=self._mode())
        return out.logits[:, -1]

    def _step(self, state: _Graph) -> torch.Tensor:
        return self._logits(state.tokens, state.cache)

    def step_fn(self) -> Callable[[_Graph], torch.Tensor]:
        """The decode step a graph captures: the step compiled by ``torch.compile`` with ``compile`` on CUDA
        (the element-wise work between the matrix products fused into few kernels; the products stay the
        project's kernels, ``kernels.ops``), else ``_step`` itself. The compiled function takes the tokens and the
        cache, not the state, so that setting the state's captured logits does not make it compile again."""
        if not (self.compile and self._use_graphs()):
            return self._step
        if self._compiled is None:
            # one compilation per batch bucket and cache capacity (and per Decoder): more than dynamo's default
            # of 8 variants of one function before it falls back to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(self._logits, dynamic=False)
        compiled = self._compiled
        return lambda state: compiled(state.tokens, state.cache)

    def _mode(self) -> str:
        return self.attention_mode or self.model.attention_mode

    def _state(self, rows: int, capacity: int, graph: bool = True) -> tuple[_Graph, float]:
        """A static cache of ``rows`` rows and at least ``capacity`` positions, with its graph on CUDA where
        ``graph`` (a call that decodes no step needs none); and the seconds spent capturing it (0 if reused)."""
        key = (rows, self._mode())
        have = self._captured.get(key)
        if have is not None and have.cache.capacity >= capacity and (have.graph is not None or not graph):
            have.cache.reset()
            return have, 0.0
        self._captured.pop(key, None)
        t0 = time.perf_counter()
        dev = self._device()
        capacity = -(-capacity // 64) * 64
        cache = StaticCache.allocate(self.model.config, rows, capacity, dev, self._dtype())
        state = _Graph(cache, torch.zeros(rows, 1, dtype=torch.long, device=dev))
        if self._use_graphs() and graph:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                # on a scratch state: one plain step builds the model's lazily made tensors (so that the compiled
                # step sees them made and never compiles again during the capture), then the step that the graph
                # captures runs twice, compiling and tuning every kernel
                self._step(state)
                for _ in range(2):
                    self.step_fn()(state)
            torch.cuda.current_stream(dev).wait_stream(stream)
            cache.reset()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                state.logits = self.step_fn()(state)
            state.graph = cuda_graph
            cache.reset()
            torch.cuda.synchronize(dev)
        self._captured[key] = state
        return state, time.perf_counter() - t0

    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
    ) -> list[torch.Tensor]:
        """The new tokens of each prompt (``[n]`` int64, at most ``max_new_tokens``; a row that stopped is cut
        after its EOS). Raises `NonFiniteLogits` (after decoding) if any step of a kept row had NaN/Inf logits."""
        out = self.generate_checked(prompts, max_new_tokens, sampling, generator, eos_token_id)
        bad = [(c.nonfinite_step, row) for row, c in enumerate(out) if c.nonfinite_step is not None]
        if bad:
            step, row = min(bad)
            raise NonFiniteLogits(f"the model gives NaN/Inf logits at generated token {step} (prompt {row})")
        return [c.tokens for c in out]

    @torch.no_grad()
    def generate_checked(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: Sampling | None,
        generator: torch.Generator | None,
        eos_token_id: int | None,
    ) -> list[Continuation]:
        """``generate`` with every argument given, reporting NaN/Inf per prompt instead of raising: each prompt's
        new tokens and the first step whose logits were not finite (0: the prefill, whose hidden states are
        checked at every position)."""
        if not prompts:
            return []
        if max_new_tokens < 1:
            return [Continuation(p.new_zeros(0), None) for p in prompts]
        if any(p.dim() != 1 or p.numel() == 0 for p in prompts):
            raise ValueError("each prompt must be a non-empty 1-D tensor of token ids")
        try:
            return self._generate(prompts, max_new_tokens, sampling or Sampling(), generator, eos_token_id)
        finally:
            progress.detail(None)

    def _generate(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        eos_token_id: int | None,
    ) -> list[Continuation]:
        """`generate_checked`'s work, telling the progress lines which part runs (`progress.detail`)."""
        dev = self._device()
        n = len(prompts)
        rows = bucket(n)
        timings = Timings()
        t0 = time.perf_counter()
        if self._use_graphs() and max_new_tokens > 1:
            progress.detail(f"capturing the decode step for {rows} row(s) (once per batch size)")
        state, timings.capture = self._state(rows, max(len(p) for p in prompts) + max_new_tokens, max_new_tokens > 1)
        t1 = time.perf_counter()
        last = torch.zeros(rows, self.model.config.vocab_size, dtype=torch.float32, device=dev)
        prefill_ok = torch.ones(rows, dtype=torch.bool, device=dev)
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        progress.detail(f"prefill of {sum(len(p) for p in prompts):,} prompt tokens ({n} prompt(s))")
        for length, same in by_length.items():
            per_call = max(1, PREFILL_TOKENS // length)
            for c in range(0, len(same), per_call):
                members = same[c : c + per_call]
                ids = torch.stack([prompts[i] for i in members]).to(dev)
                cache = SalaCache.for_config(self.model.config)
                # the last position's logits only: all of a 128K-token prompt's would take tens of GB
                normed = self.model.model(ids, cache=cache, attention_mode=self._mode())
                logits = lm_logits(self.model.config, self.model.lm_head, normed[:, -1])
                hidden_ok = torch.isfinite(normed).flatten(1).all(dim=-1)
                for j, i in enumerate(members):
                    state.cache.load_row(i, cache, j)
                    last[i] = logits[j]
                    prefill_ok[i] = hidden_ok[j]
                del cache, logits, normed
        if rows > n:  # dummy rows: one token each, never read
            state.cache.lengths[n:] = 1
        finite = [torch.isfinite(last[:n]).all(dim=-1) & prefill_ok[:n]]
        nxt = next_token(last, sampling, generator)
        done = torch.zeros(rows, 1, dtype=torch.bool, device=dev)
        out = []
        if eos_token_id is not None:
            done = nxt == eos_token_id
        out.append(nxt)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        timings.prefill = t2 - t1
        progress.detail(lambda: f"token {timings.steps + 1:,}/{max_new_tokens:,} of {n} prompt(s)")
        for step in range(1, max_new_tokens):
            if eos_token_id is not None and step % EOS_CHECK_EVERY == 0 and bool(done[:n].all()):
                break
            state.tokens.copy_(nxt)
            if state.graph is not None:
                state.graph.replay()
                assert state.logits is not None
                logits = state.logits
            else:
                logits = self._step(state)
            finite.append(torch.isfinite(logits[:n]).all(dim=-1) | done[:n, 0])
            nxt = next_token(logits, sampling, generator)
            if eos_token_id is not None:
                nxt = nxt.masked_fill(done, eos_token_id)
                done = done | (nxt == eos_token_id)
            out.append(nxt)
            timings.steps += 1
        tokens = torch.cat(out, dim=1)[:n].cpu()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        timings.decode = time.perf_counter() - t2
        timings.prefill += t1 - t0 - timings.capture
        self.timings = timings
        bad = ~torch.stack(finite, dim=1).cpu()
        first = [int(r.nonzero()[0]) if bool(r.any()) else None for r in bad]
        return [Continuation(_cut(t, eos_token_id), f) for t, f in zip(tokens, first, strict=True)]

    def generate_in_batches(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        batch_size: int = 16,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
    ) -> list[torch.Tensor]:
        """``generate`` over ``prompts`` in batches of ``batch_size``, in order (each batch reuses the graph of
        its bucket)."""
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), batch_size):
            out += self.generate(
                prompts[i : i + batch_size], max_new_tokens, sampling, generator=generator, eos_token_id=eos_token_id
            )
        return out


def _cut(tokens: torch.Tensor, eos: int | None) -> torch.Tensor:
    if eos is None:
        return tokens
    hits = (tokens == eos).nonzero()
    return tokens[: int(hits[0]) + 1] if hits.numel() else tokens
