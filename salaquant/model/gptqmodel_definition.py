"""MiniCPM-SALA described to GPTQModel: `SalaQModel`, added to its model map when this module is imported.

salaquant's import hook imports this module once ``gptqmodel`` has loaded (``salaquant.model.auto_register``),
so after ``import salaquant`` ``GPTQModel.load(export)`` builds quantized linears exactly where a GPTQ export
stores them (its ``dynamic`` rules give per-module bits and exclusions), and ``GPTQModel.load(bf16 checkpoint,
quantize_config)`` can quantize a SALA checkpoint. Without a definition GPTQModel derives the layer tree from
layer 0, a minicpm4 layer, and leaves every lightning layer's ``z_proj`` unloaded. GPTQModel has no public
registration call; its loaders look the model type up in ``gptqmodel.models.auto.MODEL_MAP`` after checking
``SUPPORTED_MODELS``, so the definition is added to both.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from gptqmodel.models import auto
from gptqmodel.models.base import BaseQModel

from .config import MODEL_TYPE
from .modeling import layer_rope

ATTENTION_MODE = "dense"
"""How the decoder layers attend while GPTQModel replays them (what salaquant's calibration uses)."""


class SalaQModel(BaseQModel):  # type: ignore[misc]
    """Decoder layers at ``model.layers``; per layer, in execution order: the attention input group (q/k/v and
    the output gate: ``o_gate`` in minicpm4 layers, ``z_proj`` in lightning layers), ``o_proj``, the MLP input
    group (gate/up) and ``down_proj`` (``salaquant.model.layout.input_groups``). The tree lists the union of
    both layer kinds' modules; ``layer_modules_strict = False`` makes GPTQModel skip, per layer, the names that
    layer does not have. ``:!`` marks modules that are never quantized (norms)."""

    layer_modules_strict = False
    pre_lm_head_norm_module = "model.norm"
    module_tree: ClassVar[list[Any]] = [
        "model",
        "layers",
        "#",
        {
            "input_layernorm": ("input_layernorm:!",),
            "self_attn": (
                "q_proj:0",
                "k_proj:0",
                "v_proj:0",
                "o_gate:0",
                "z_proj:0",
                "q_norm:!",
                "k_norm:!",
                "o_norm:!:1",
                "o_proj:1",
            ),
            "post_attention_layernorm": ("post_attention_layernorm:!",),
            "mlp": ("gate_proj:0", "up_proj:0", "down_proj:1"),
        },
    ]

    def capture_first_layer_input_kwargs(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch_device: torch.device,
        layer_input_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        # The decoder calls layer(h, rope, cache, mode) positionally; GPTQModel keeps only args[0], so the
        # rest is rebuilt per layer in prepare_layer_replay_kwargs.
        return {}

    def prepare_layer_replay_kwargs(
        self,
        layer: torch.nn.Module,
        layer_input: list[torch.Tensor],
        additional_inputs: dict[str, Any],
        target_device: torch.device,
    ) -> dict[str, Any]:
        # A decoder layer takes no attention_mask / position_ids / use_cache: GPTQModel's replay arguments are
        # replaced by the layer's own (RoPE tables of its kind, no cache, dense attention).
        hidden = layer_input[0]
        rope = layer_rope(self.model.sala_config, layer.kind, 0, hidden.shape[1], target_device)
        return {"rope": rope, "cache": None, "mode": ATTENTION_MODE}


def register() -> None:
    """Add `SalaQModel` to GPTQModel's model map (idempotent)."""
    auto.MODEL_MAP[MODEL_TYPE] = SalaQModel
    if MODEL_TYPE not in auto.SUPPORTED_MODELS:
        auto.SUPPORTED_MODELS.append(MODEL_TYPE)


register()
