"""The architecture table of MiniCPM-SALA: every tensor per layer type, which linears share an input and
which norm produces it, which projections the serving engines fuse, how each linear splits under tensor
parallelism, and which blocks SGLang excludes from quantization together.

The one place these facts live: the model builder, the tiny-model writer, ``inspect``, checkpoint
validation, smoothing, both quantizers, the byte formats, the checker and the runtime read them here.
Names are the real checkpoint's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import LIGHTNING, SPARSE, SalaConfig


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer inside a decoder layer: ``name`` is relative to ``model.layers.{i}.``."""

    name: str
    out_features: int
    in_features: int


def head_dim(config: SalaConfig, kind: str) -> int:
    """Attention head size of a decoder layer of the given mixer kind (lightning layers have their own)."""
    if kind == SPARSE:
        return config.head_dim
    if kind == LIGHTNING:
        return config.lightning_head_dim
    raise ValueError(f"unknown layer kind {kind!r}")


def layer_linears(config: SalaConfig, kind: str) -> list[LinearSpec]:
    """The linears of one decoder layer of the given mixer kind, in execution order."""
    h, inter = config.hidden_size, config.intermediate_size
    if kind == SPARSE:
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        gate = "self_attn.o_gate" if config.attn_use_output_gate else None
    elif kind == LIGHTNING:
        heads, kv_heads, head_dim = config.lightning_nh, config.lightning_nkv, config.lightning_head_dim
        gate = "self_attn.z_proj" if config.use_output_gate else None
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    qd, kvd = heads * head_dim, kv_heads * head_dim
    attn = [
        LinearSpec("self_attn.q_proj", qd, h),
        LinearSpec("self_attn.k_proj", kvd, h),
        LinearSpec("self_attn.v_proj", kvd, h),
        *([LinearSpec(gate, qd, h)] if gate else []),
        LinearSpec("self_attn.o_proj", h, qd),
    ]
    mlp = [
        LinearSpec("mlp.gate_proj", inter, h),
        LinearSpec("mlp.up_proj", inter, h),
        LinearSpec("mlp.down_proj", h, inter),
    ]
    return attn + mlp


LAST_LINEAR = "mlp.down_proj"
"""The decoder layer's last product, in both mixer kinds: its output only enters the layer's residual sum, so a
pass that drops the layer's output needs its input but not its product."""


def layer_norms(config: SalaConfig, kind: str) -> dict[str, int]:
    """Norm weights of one decoder layer (relative name -> size)."""
    h = config.hidden_size
    norms = {"input_layernorm": h, "post_attention_layernorm": h}
    if kind == LIGHTNING:
        if config.qk_norm:
            norms["self_attn.q_norm"] = config.lightning_head_dim
            norms["self_attn.k_norm"] = config.lightning_head_dim
        if config.use_output_norm:
            norms["self_attn.o_norm"] = config.lightning_nh * config.lightning_head_dim
    return norms


def layer_parameter_shapes(config: SalaConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Full tensor names and shapes of decoder layer ``index``."""
    kind = config.mixer_types[index]
    prefix = f"model.layers.{index}."
    shapes: dict[str, tuple[int, ...]] = {}
    for name, size in layer_norms(config, kind).items():
        shapes[f"{prefix}{name}.weight"] = (size,)
    for spec in layer_linears(config, kind):
        shapes[f"{prefix}{spec.name}.weight"] = (spec.out_features, spec.in_features)
    return shapes


def global_parameter_shapes(config: SalaConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def parameter_shapes(config: SalaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in file order (embeddings, layers, final norm, lm_head)."""
    glob = global_parameter_shapes(config)
    shapes = {"model.embed_tokens.weight": glob["model.embed_tokens.weight"]}
    for i in range(config.num_hidden_layers):
        shapes.update(layer_parameter_shapes(config, i))
    shapes["model.norm.weight"] = glob["model.norm.weight"]
    if "lm_head.weight" in glob:
        shapes["lm_head.weight"] = glob["lm_head.weight"]
    return shapes


_ROTARY_FREQUENCIES = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def derived_tensor(config: SalaConfig, name: str) -> bool:
    """Whether a stored tensor outside `parameter_shapes` is one the model rebuilds rather than reads: rotary
    frequencies (``model.layers.{i}.self_attn.rotary_emb.inv_freq``, computed from ``rope_theta``; transformers
    saved them before it made them non-persistent buffers) and, under ``tie_word_embeddings``, a stored
    ``lm_head.weight`` (transformers, vLLM and SGLang tie the head to the embeddings and ignore the copy)."""
    return bool(_ROTARY_FREQUENCIES.fullmatch(name)) or (name == "lm_head.weight" and config.tie_word_embeddings)


GROUP_NAMES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
"""The input groups of every decoder layer, in execution order (``input_groups``)."""


@dataclass(frozen=True)
class InputGroup:
    """Linears of one decoder layer that read the same input tensor (so share one Hessian).

    ``source`` names what produces that input: a norm (``input_layernorm``, ``self_attn.o_norm``,
    ``post_attention_layernorm``), ``attention`` (the gated attention output of minicpm4 layers, which no
    norm precedes) or ``mlp.up_proj`` (the down_proj input is act(gate) * up, scaled per channel by up's rows).
    ``producer`` says how a per-channel scale of that input folds into what produces it: ``"norm"`` (divide
    the norm's weight), ``"rows"`` (divide up_proj's output rows) or ``None`` (nothing to fold into).
    """

    name: str
    source: str
    members: tuple[str, ...]
    producer: str | None


def input_groups(config: SalaConfig, kind: str) -> list[InputGroup]:
    """The input groups of a layer of the given kind, in execution order."""
    if kind == SPARSE:
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        first = qkv + (("self_attn.o_gate",) if config.attn_use_output_gate else ())
        o_source, o_producer = "attention", None
    elif kind == LIGHTNING:
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        first = qkv + (("self_attn.z_proj",) if config.use_output_gate else ())
        o_source, o_producer = ("self_attn.o_norm", "norm") if config.use_output_norm else ("attention", None)
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    return [
        InputGroup("attn_in", "input_layernorm", first, "norm"),
        InputGroup("attn_out", o_source, ("self_attn.o_proj",), o_producer),
        InputGroup("mlp_in", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"),
        InputGroup("mlp_out", "mlp.up_proj", ("mlp.down_proj",), "rows"),
    ]


# Fused parameters of the serving engines (vLLM / SGLang stacked_params_mapping): members must share
# precision, bits and group size, and NVFP4 global scales.
FUSED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
FUSED_OF: dict[str, str] = {m: fused for fused, members in FUSED_PARAMETERS.items() for m in members}
"""Member -> fused parameter (``self_attn.k_proj`` -> ``self_attn.qkv_proj``)."""
RUNTIME_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkvz_proj": (*FUSED_PARAMETERS["self_attn.qkv_proj"], "self_attn.z_proj"),
    "self_attn.qkvg_proj": (*FUSED_PARAMETERS["self_attn.qkv_proj"], "self_attn.o_gate"),
    **FUSED_PARAMETERS,
}
"""The linears the runtime runs as one, tried in this order (a parent module holds one fused linear at most): first
q/k/v with the layer's output gate (``z_proj`` on the lightning layers, ``o_gate`` on the minicpm4 ones; all four
read the layer's normed input), else the engines' groups. The exported files keep the engines' layout; only the
loaded model differs."""

_LAYER_LINEAR = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)")


def split_layer_name(name: str) -> tuple[int, str] | None:
    """``model.layers.3.mlp.up_proj`` -> ``(3, "mlp.up_proj")``; None for a name outside the decoder layers."""
    m = _LAYER_LINEAR.fullmatch(name)
    return (int(m[1]), m[2]) if m else None


def linear_names(config: SalaConfig) -> list[str]:
    """Full names of every decoder linear (``model.layers.{i}.{linear}``), layer by layer: the names that
    ``--exclude`` patterns and bits rules select from."""
    return [
        f"model.layers.{i}.{s.name}" for i, kind in enumerate(config.mixer_types) for s in layer_linears(config, kind)
    ]


def unmatched(patterns: list[re.Pattern[str]], names: list[str]) -> int | None:
    """Index of the first pattern that matches (``re.search``) none of ``names``, or None. A pattern that
    selects no linear is a typo: the run it belongs to would quietly be another run than the one asked for."""
    return next((k for k, p in enumerate(patterns) if not any(p.search(n) for n in names)), None)


def no_match(what: str, pattern: str, names: list[str]) -> str:
    """The refusal of a pattern that matches none of ``names``: what follows from it, what names look like."""
    return (
        f"{what} '{pattern}' matches no linear of this model, so it would change nothing (patterns are regular "
        f"expressions searched in names such as {names[0]} or {names[-1]})"
    )


def fused_name(name: str) -> str | None:
    """``model.layers.3.self_attn.k_proj`` -> ``model.layers.3.self_attn.qkv_proj``; None if not fused."""
    parts = split_layer_name(name)
    fused = FUSED_OF.get(parts[1]) if parts else None
    return None if parts is None or fused is None else f"model.layers.{parts[0]}.{fused}"


# Tensor-parallel split of each decoder linear, as vLLM / SGLang shard it: "column" splits the outputs,
# "row" the inputs, "heads" the outputs by whole heads, "kv_heads" likewise but with each rank holding one
# replicated head when there are fewer heads than ranks.
TP_SPLIT: dict[str, str] = {
    "self_attn.q_proj": "heads",
    "self_attn.k_proj": "kv_heads",
    "self_attn.v_proj": "kv_heads",
    "self_attn.o_gate": "column",
    "self_attn.z_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "mlp.down_proj": "row",
}

EXCLUDED_TOGETHER = ("self_attn",)
"""Blocks SGLang builds unquantized as a whole as soon as one of their linears is excluded (its exclusion
cascade): excluding ``model.layers.{i}.self_attn.o_proj`` from quantization excludes all of that layer's
attention linears."""


def exclusion_block(relative: str) -> str | None:
    """The block of ``EXCLUDED_TOGETHER`` that a layer-relative linear name belongs to, or None."""
    block = relative.split(".", 1)[0]
    return block if block in EXCLUDED_TOGETHER else None
