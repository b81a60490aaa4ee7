"""The budget (``6.5GB`` of tensor bytes, or ``4.5bits`` per decoder-linear weight) and the units it is spent on.

A unit is what takes one option as a whole: a fused group (q/k/v, gate/up), any other linear, or for NVFP4 an
attention block that SGLang builds unquantized as a whole. Sizes are tensor bytes as the format modules count
them; the export's other tensors (embeddings, norms, lm_head, and linears kept out of the choice) are fixed.
A bits budget counts every decoder linear's bytes over its weights, scales and zeros included: gptq_marlin's
4-bit g128 is about 4.16 bits, 8-bit about 8.19, bf16 16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..io.reader import CheckpointReader
from ..model.config import SalaConfig
from ..model.layout import global_parameter_shapes, layer_linears, layer_norms
from ..settings import parse_size

_BITS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*bits?\s*$", re.IGNORECASE)


class BudgetError(ValueError):
    """A budget that cannot be read or met; the message names the value and the sizes it can take."""


@dataclass(frozen=True)
class Budget:
    """``bytes`` of tensors in the export, or ``bits`` per decoder-linear weight (exactly one is set)."""

    text: str
    bytes: int | None = None
    bits: float | None = None

    def target(self, fixed: int, linear_weights: int) -> int:
        """The budget in tensor bytes: ``fixed`` bytes outside the decoder linears plus their share."""
        if self.bytes is not None:
            return self.bytes
        assert self.bits is not None
        return fixed + int(self.bits * linear_weights / 8)


def parse_budget(text: str) -> Budget:
    """``"6.5GB"``, ``"5GiB"``, ``"700000000"`` (bytes) or ``"4.5bits"``."""
    m = _BITS.match(text)
    if m:
        bits = float(m[1])
        if not 0 < bits <= 16:
            raise BudgetError(f"budget {text!r}: bits per weight must lie in (0, 16]")
        return Budget(text=text, bits=bits)
    try:
        return Budget(text=text, bytes=parse_size(text))
    except ValueError:
        raise BudgetError(f"budget {text!r}: expected a size such as 6.5GB or 5GiB, or bits such as 4.5bits") from None


@dataclass(frozen=True)
class Unit:
    """Linears of one decoder layer that take one option together: ``options`` (labels, the unquantized one last)
    with their tensor ``sizes``; a unit with one option has no choice (its linears are kept as they are)."""

    layer: int
    name: str  # layer-relative: "self_attn.qkv_proj", "mlp.down_proj", "self_attn" (an NVFP4 block)
    members: tuple[str, ...]  # layer-relative linear names
    options: tuple[str, ...]
    sizes: tuple[int, ...]
    weights: int  # weights of the members

    @property
    def full_name(self) -> str:
        return f"model.layers.{self.layer}.{self.name}"


def fixed_bytes(reader: CheckpointReader, config: SalaConfig) -> int:
    """Bytes of the export's tensors outside the decoder linears: the globals as stored, layer norms in bf16."""
    total = sum(reader.nbytes(name) for name in global_parameter_shapes(config))
    return total + sum(2 * sum(layer_norms(config, kind).values()) for kind in config.mixer_types)


def linear_weights(config: SalaConfig) -> int:
    """Weights of every decoder linear (the denominator of a bits budget)."""
    return sum(s.out_features * s.in_features for kind in config.mixer_types for s in layer_linears(config, kind))


def describe_bytes(n: int, linear_weights: int, fixed: int) -> str:
    """``"8.80 MB (4.16 bits)"``: tensor bytes and the decoder linears' bits per weight they mean."""
    return f"{n / 1e6:,.2f} MB ({8 * (n - fixed) / linear_weights:.2f} bits)"
