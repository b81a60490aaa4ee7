"""MiniCPM-SALA decoder: one definition used by calibration, the runtime, eval and the transformers wrapper."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import LightningAttention, SparseAttention
from .cache import SalaCache
from .config import ATTENTION_MODES, LIGHTNING, SalaConfig
from .layers import MLP, RMSNorm, rope_cos_sin
from .sampling import Sampling, next_token
from .static_cache import StaticCache


def layer_rope(config: SalaConfig, kind: str, start: int, length: int, device: torch.device | str):
    """cos/sin for positions [start, start+length) of layers of the given kind (None when they use no RoPE)."""
    return rope_at(config, kind, torch.arange(start, start + length, device=device))


def rope_at(config: SalaConfig, kind: str, positions: torch.Tensor):
    """cos/sin ``[T, D]`` (or ``[B, T, D]`` for per-row ``positions [B, T]``) of layers of the given kind; None
    when they use no RoPE."""
    use = config.lightning_use_rope if kind == LIGHTNING else config.attn_use_rope
    if not use:
        return None
    head_dim = config.lightning_head_dim if kind == LIGHTNING else config.head_dim
    factor = float(config.rope_scaling.get("factor", 1.0)) if config.rope_scaling else 1.0
    return rope_cos_sin(positions, head_dim, config.rope_theta, factor)


class DecoderLayer(nn.Module):
    """Pre-norm block; each branch output is multiplied by scale_depth / sqrt(num_layers) before the add."""

    def __init__(self, config: SalaConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.kind = config.mixer_types[index]
        self.residual_scale = config.residual_scale
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: LightningAttention | SparseAttention = (
            LightningAttention(config) if self.kind == LIGHTNING else SparseAttention(config)
        )
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, rope, cache=None, mode: str = "auto") -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), rope, cache, mode)
        h = h + attn * self.residual_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale


class DecoderStack:
    """What a decoder does with its ``embed_tokens``, ``layers`` and ``norm`` under ``sala_config``: shared by
    `SalaModel` and the transformers base model (``salaquant.model.hf``), which own the same modules under the
    same names (``model.*`` in the checkpoint) but different base classes."""

    sala_config: SalaConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm

    def build_stack(self, config: SalaConfig) -> None:
        """Create the modules (call once the ``nn.Module`` is initialised)."""
        self.sala_config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.sala_config.scale_emb

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: SalaCache | StaticCache | None = None,
        attention_mode: str = "auto",
    ) -> torch.Tensor:
        """Final-norm hidden states; with a cache, the tokens continue each row's cached ones (a `StaticCache`
        takes one token per row, at each row's own position)."""
        if attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode {attention_mode!r}: expected one of {ATTENTION_MODES}")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        h = inputs_embeds
        t = h.shape[1]
        config = self.sala_config
        positions = cache.positions(t, h.device) if cache is not None else torch.arange(t, device=h.device)
        tables = {kind: rope_at(config, kind, positions) for kind in set(config.mixer_types)}
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            h = layer(h, tables[layer.kind], layer_cache, attention_mode)
        if cache is not None:
            cache.advance(t)
        return self.norm(h)


class SalaModel(DecoderStack, nn.Module):
    """Embeddings, decoder layers and final norm (``model.*`` in the checkpoint), as a plain ``nn.Module``."""

    def __init__(self, config: SalaConfig) -> None:
        super().__init__()
        self.build_stack(config)


@dataclass
class CausalLMResult:
    logits: torch.Tensor
    loss: torch.Tensor | None
    cache: SalaCache | StaticCache | None


def lm_logits(config: SalaConfig, lm_head: nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``lm_head(norm(h) / (hidden_size / dim_model_base))``."""
    return lm_head(normed / config.logit_divisor).float()


def shifted_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (labels == -100 ignored)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


class SalaForCausalLM(nn.Module):
    """Plain-PyTorch causal LM with the checkpoint's tensor names (``model.*``, ``lm_head``)."""

    def __init__(self, config: SalaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = SalaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_mode = "auto"

    def new_cache(self) -> SalaCache:
        return SalaCache.for_config(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: SalaCache | StaticCache | None = None,
        attention_mode: str | None = None,
    ) -> CausalLMResult:
        normed = self.model(input_ids, cache=cache, attention_mode=attention_mode or self.attention_mode)
        logits = lm_logits(self.config, self.lm_head, normed)
        loss = shifted_nll(logits, labels) if labels is not None else None
        return CausalLMResult(logits=logits, loss=loss, cache=cache)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
        attention_mode: str | None = None,
    ) -> torch.Tensor:
        """Decoding with the cache: prefill once, then one token per step, chosen as ``sampling`` says (greedy by
        default; ``generator`` makes sampling reproducible). Stops early once every row has produced
        ``eos_token_id`` (kept in the output; rows that finished first are padded with it). NaN/Inf logits at any
        step raise `NonFiniteLogits` once decoding ends (tracked on the device: no synchronisation per token), so
        a damaged checkpoint never yields text that looks like an answer."""
        sampling = sampling or Sampling()
        cache = self.new_cache()
        out = self(input_ids, cache=cache, attention_mode=attention_mode)
        tokens = [input_ids]
        finite = []
        done = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            finite.append(torch.isfinite(out.logits[:, -1]).all())
            nxt = next_token(out.logits[:, -1], sampling, generator)
            if eos_token_id is not None:
                nxt = nxt.masked_fill(done, eos_token_id)
                done = done | (nxt == eos_token_id)
            tokens.append(nxt)
            if (eos_token_id is not None and bool(done.all())) or step == max_new_tokens - 1:
                break
            out = self(nxt, cache=cache, attention_mode=attention_mode)
        if finite and not bool(torch.stack(finite).all()):
            step = int((~torch.stack(finite)).nonzero()[0])
            raise NonFiniteLogits(f"the model gives NaN/Inf logits at generated token {step}")
        return torch.cat(tokens, dim=1)

    def greedy(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mode: str | None = None) -> torch.Tensor:
        """Greedy decoding with the cache: prefill once, then one token per step."""
        return self.generate(input_ids, max_new_tokens, attention_mode=attention_mode)


class NonFiniteLogits(RuntimeError):
    """Decoding met NaN/Inf logits (a damaged checkpoint or numerics gone wrong)."""


def init_weights(model: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) for linears and embeddings, ones for norms (what a random SALA checkpoint holds)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
