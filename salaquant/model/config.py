"""MiniCPM-SALA configuration, read from (and written back to) the real ``config.json`` format."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPE = "minicpm_sala"
SPARSE = "minicpm4"
LIGHTNING = "lightning"
LIGHTNING_SPELLINGS = frozenset({"lightning", "lightning_attn", "lightning-attn"})
ATTENTION_MODES = ("auto", "dense", "sparse")

DEFAULT_SPARSE_CONFIG: dict[str, Any] = {
    "kernel_size": 32,
    "kernel_stride": 16,
    "init_blocks": 1,
    "block_size": 64,
    "window_size": 2048,
    "topk": 64,
    "use_nope": False,
    "dense_len": 8192,
}
"""MiniCPM-SALA's ``sparse_config``: a config.json's missing keys take these, and so do ``SparseParams``' fields."""


class ConfigError(ValueError):
    """A config.json that is not a valid MiniCPM-SALA configuration; the message names the key."""


def normalize_mixer(value: object, index: int) -> str:
    """Map a ``mixer_types`` entry to ``"minicpm4"`` or ``"lightning"``."""
    if value == SPARSE:
        return SPARSE
    if isinstance(value, str) and value in LIGHTNING_SPELLINGS:
        return LIGHTNING
    raise ConfigError(f"mixer_types[{index}] = {value!r}: expected 'minicpm4' or one of {sorted(LIGHTNING_SPELLINGS)}")


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config key '{key}' is missing (required for model_type '{MODEL_TYPE}')")
    return raw[key]


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default) if default is not None else _require(raw, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config key '{key}' must be a positive integer, got {value!r}")
    return value


def _number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    return float(value)


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    return value


@dataclass
class SalaConfig:
    """Every architecture field of a MiniCPM-SALA checkpoint.

    ``raw`` keeps the whole original dict so that writing the config back loses no key
    (auto_map, token ids, transformers_version, quantization_config, ...).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mixer_types: list[str]
    lightning_nh: int
    lightning_nkv: int
    lightning_head_dim: int
    lightning_scale: float
    sparse_config: dict[str, Any] | None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 524288
    attn_use_rope: bool = False
    lightning_use_rope: bool = True
    qk_norm: bool = True
    use_output_gate: bool = True
    use_output_norm: bool = True
    attn_use_output_gate: bool = True
    scale_emb: float = 12.0
    scale_depth: float = 1.4
    dim_model_base: int = 256
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ derived values
    @property
    def residual_scale(self) -> float:
        """Branch-output multiplier before each residual add: scale_depth / sqrt(num_layers)."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logit_divisor(self) -> float:
        """The final hidden state is divided by hidden_size / dim_model_base before lm_head."""
        return self.hidden_size / self.dim_model_base

    @property
    def dense_len(self) -> int | None:
        """Total length from which minicpm4 layers switch to sparse attention (None: never)."""
        if self.sparse_config is None:
            return None
        return int(self.sparse_config["dense_len"])

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SalaConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ConfigError(
                f"config key 'model_type' is {model_type!r}; salaquant handles MiniCPM-SALA "
                f"checkpoints (model_type '{MODEL_TYPE}') only"
            )
        hidden = _positive_int(raw, "hidden_size")
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = _positive_int(raw, "num_key_value_heads", heads)
        layers = _positive_int(raw, "num_hidden_layers")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"config key 'num_attention_heads' ({heads}) does not divide 'hidden_size' ({hidden}) "
                    "and no 'head_dim' is given"
                )
            head_dim = hidden // heads
        head_dim = _positive_int({"head_dim": head_dim}, "head_dim")
        if heads % kv_heads:
            raise ConfigError(
                f"config key 'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' ({heads})"
            )

        mixers_raw = _require(raw, "mixer_types")
        if not isinstance(mixers_raw, list):
            raise ConfigError(f"config key 'mixer_types' must be a list, got {type(mixers_raw).__name__}")
        if len(mixers_raw) != layers:
            raise ConfigError(
                f"config key 'mixer_types' has {len(mixers_raw)} entries but 'num_hidden_layers' is {layers}"
            )
        mixers = [normalize_mixer(m, i) for i, m in enumerate(mixers_raw)]

        l_nh = _positive_int(raw, "lightning_nh", heads)
        l_nkv = _positive_int(raw, "lightning_nkv", l_nh)
        l_hd = _positive_int(raw, "lightning_head_dim", head_dim)
        if l_nh % l_nkv:
            raise ConfigError(f"config key 'lightning_nkv' ({l_nkv}) must divide 'lightning_nh' ({l_nh})")
        scale_raw = raw.get("lightning_scale", "1/sqrt(d)")
        if scale_raw == "1/sqrt(d)":
            l_scale = l_hd**-0.5
        elif scale_raw in ("1", 1, 1.0):
            l_scale = 1.0
        elif isinstance(scale_raw, (int, float)) and not isinstance(scale_raw, bool):
            l_scale = float(scale_raw)
        else:
            raise ConfigError(f"config key 'lightning_scale' = {scale_raw!r}: expected '1/sqrt(d)' or a number")

        sparse = raw.get("sparse_config")
        if sparse is not None:
            if not isinstance(sparse, dict):
                raise ConfigError("config key 'sparse_config' must be an object or null")
            sparse = {**DEFAULT_SPARSE_CONFIG, **sparse}
            for key in ("kernel_size", "kernel_stride", "block_size", "window_size", "topk"):
                _positive_int(sparse, key)
                sparse[key] = int(sparse[key])
            if sparse["block_size"] % sparse["kernel_stride"]:
                raise ConfigError(
                    "config key 'sparse_config.block_size' must be a multiple of 'sparse_config.kernel_stride'"
                )
            if not isinstance(sparse["dense_len"], int) or isinstance(sparse["dense_len"], bool):
                raise ConfigError("config key 'sparse_config.dense_len' must be an integer")
            if SPARSE in mixers and heads // kv_heads < 1:
                raise ConfigError("sparse layers need num_attention_heads >= num_key_value_heads")

        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type")) if isinstance(rope_scaling, dict) else None
            if kind not in ("linear", "default"):
                raise ConfigError(
                    f"config key 'rope_scaling' = {rope_scaling!r}: only null, 'default' and 'linear' are supported"
                )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config key 'hidden_act' = {act!r}: MiniCPM-SALA uses 'silu'")
        if raw.get("attention_bias", False):
            raise ConfigError("config key 'attention_bias' = true is not a MiniCPM-SALA layout")
        if raw.get("lightning_layerwise_decay", False):
            raise ConfigError(
                "config key 'lightning_layerwise_decay' = true (a decay scaled per layer) is not MiniCPM-SALA's: "
                "its lightning layers decay by the per-head slopes alone"
            )

        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            mixer_types=mixers,
            lightning_nh=l_nh,
            lightning_nkv=l_nkv,
            lightning_head_dim=l_hd,
            lightning_scale=l_scale,
            sparse_config=sparse,
            rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=_number(raw, "rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", 524288),
            attn_use_rope=_flag(raw, "attn_use_rope", False),
            lightning_use_rope=_flag(raw, "lightning_use_rope", True),
            qk_norm=_flag(raw, "qk_norm", True),
            use_output_gate=_flag(raw, "use_output_gate", True),
            use_output_norm=_flag(raw, "use_output_norm", True),
            attn_use_output_gate=_flag(raw, "attn_use_output_gate", True),
            scale_emb=_number(raw, "scale_emb", 1.0),
            scale_depth=_number(raw, "scale_depth", 1.0),
            dim_model_base=_positive_int(raw, "dim_model_base", hidden),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            raw=copy.deepcopy(raw),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> SalaConfig:
        """The config of a checkpoint folder, or of the JSON file ``path`` names. A file that is not JSON text (a
        weights file, say) is refused as what it is, not as a config that fails to parse."""
        path = Path(path)
        given_file = path.is_file()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json found")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if given_file and path.name != "config.json":
                raise ConfigError(f"{path} is not a checkpoint folder or its config.json ({exc})") from exc
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The original dict with every architecture field stated, defaults included (mixer spellings preserved),
        so that an engine reading it cannot fall back to a default of its own that differs from ours."""
        out = copy.deepcopy(self.raw)
        out["model_type"] = MODEL_TYPE
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "lightning_nh",
            "lightning_nkv",
            "lightning_head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "attn_use_rope",
            "lightning_use_rope",
            "qk_norm",
            "use_output_gate",
            "use_output_norm",
            "attn_use_output_gate",
            "scale_emb",
            "scale_depth",
            "dim_model_base",
            "tie_word_embeddings",
            "hidden_act",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            out[key] = getattr(self, key)
        if (
            "mixer_types" not in out
            or [normalize_mixer(m, i) for i, m in enumerate(out["mixer_types"])] != self.mixer_types
        ):
            out["mixer_types"] = ["lightning-attn" if m == LIGHTNING else m for m in self.mixer_types]
        out["sparse_config"] = copy.deepcopy(self.sparse_config)
        # spelled as SGLang's parser takes it: the formula, or the number it stands for
        scale = self.raw.get("lightning_scale", "1/sqrt(d)")
        out["lightning_scale"] = scale if scale == "1/sqrt(d)" else self.lightning_scale
        out["lightning_layerwise_decay"] = False
        out["attention_bias"] = self.attention_bias
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
