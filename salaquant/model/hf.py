"""transformers integration: ``AutoConfig`` / ``AutoModelForCausalLM`` for model_type ``minicpm_sala``.

Importing this module registers the classes, after which a SALA checkpoint loads with
``AutoModelForCausalLM.from_pretrained(path)``: no remote code, no fla, no flash-attn. The modules are
the same ``salaquant.model`` ones used everywhere else; ``generate()`` runs with ``SalaCache``.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import SalaCache
from .config import MODEL_TYPE, SalaConfig
from .layers import RMSNorm
from .modeling import DecoderStack, lm_logits, shifted_nll


class MiniCPMSALAConfig(PretrainedConfig):
    """Holds every key of the checkpoint's config.json; ``sala`` gives the validated ``SalaConfig``."""

    model_type = MODEL_TYPE

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        if kwargs.get("rope_scaling", "absent") is None:
            kwargs.pop("rope_scaling")  # null is the default; passing it trips a deprecation warning
        super().__init__(**kwargs)

    @property
    def sala(self) -> SalaConfig:
        return SalaConfig.from_dict(self.to_dict())


# transformers renamed ``past_key_values`` to ``cache`` in its 5.x series; speak whichever it expects.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class MiniCPMSALAPreTrainedModel(PreTrainedModel):
    """transformers' contract for the SALA classes: config class, base model prefix, no-split modules, weight
    init. Both classes below derive from it, so the base model (``model``) is a ``PreTrainedModel`` too, which
    is what transformers' quantizers, ``device_map`` planning and ``save_pretrained`` read from it."""

    config_class = MiniCPMSALAConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: torch.nn.Module) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


class MiniCPMSALAModel(DecoderStack, MiniCPMSALAPreTrainedModel):
    """The decoder (``model.*``): ``salaquant.model``'s modules and forward (`DecoderStack`) as transformers'
    base model; returns the final-norm hidden states."""

    def __init__(self, config: MiniCPMSALAConfig) -> None:
        super().__init__(config)
        self.build_stack(config.sala)
        self.post_init()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.embed_tokens = value


class MiniCPMSALAForCausalLM(MiniCPMSALAPreTrainedModel, GenerationMixin):
    _is_stateful = True

    def __init__(self, config: MiniCPMSALAConfig) -> None:
        super().__init__(config)
        self.sala_config = config.sala
        self.model = MiniCPMSALAModel(config)
        self.lm_head = torch.nn.Linear(self.sala_config.hidden_size, self.sala_config.vocab_size, bias=False)
        self.attention_mode = "auto"
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own SalaCache (KV + compressed K + GLA states)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: SalaCache | None = None,
        past_key_values: SalaCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        attention_mode: str | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "padded batches are not supported by the SALA reference model: pass sequences of equal length "
                "(or one at a time) with no padding"
            )
        cache = cache if cache is not None else past_key_values
        if cache is None and (use_cache if use_cache is not None else False):
            cache = SalaCache.for_config(self.sala_config)
        if cache is not None and not isinstance(cache, SalaCache):
            raise TypeError(f"MiniCPM-SALA needs a SalaCache, got {type(cache).__name__}")
        normed = self.model(input_ids, inputs_embeds, cache=cache, attention_mode=attention_mode or self.attention_mode)
        if logits_to_keep:
            normed = normed[:, -logits_to_keep:]
        logits = lm_logits(self.sala_config, self.lm_head, normed)
        loss = shifted_nll(logits, labels) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        cache: SalaCache | None = None,
        past_key_values: SalaCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        cache = cache if cache is not None else past_key_values
        if cache is not None and cache.seen_tokens > 0:
            input_ids = input_ids[:, cache.seen_tokens :]
            inputs_embeds = None
        inputs: dict[str, Any] = {
            _CACHE_FIELD: cache,
            "use_cache": use_cache,
            "attention_mask": attention_mask,
        }
        if inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids
        return inputs


def register() -> None:
    """Register the SALA classes with transformers' Auto classes (idempotent)."""
    with contextlib.suppress(ValueError):  # already registered
        AutoConfig.register(MODEL_TYPE, MiniCPMSALAConfig)
    with contextlib.suppress(ValueError):
        AutoModelForCausalLM.register(MiniCPMSALAConfig, MiniCPMSALAForCausalLM)


register()
