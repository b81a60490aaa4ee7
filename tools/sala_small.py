"""sala-small: its configuration, the fast training path and the checkpoint writer shared by the training, check
and eval tools.

The model is the real MiniCPM-SALA design at 12.6M parameters: 8 layers with minicpm4 at 0 and 7 (the real 1:3
ratio), hidden 256, intermediate 768, head_dim 128 everywhere (minicpm4: 8 query heads over 2 KV heads, no RoPE,
o_gate; lightning: 4 heads with RoPE, q/k norms, z_proj and o_norm), the real scale_emb / scale_depth /
dim_model_base and the real ``sparse_config`` (dense_len 8192: 16K prompts run InfLLM-v2 sparse attention).

The fast path changes two kernels only, never the module structure or the math: the lightning layers' Simple GLA
runs fla-core's chunked Triton kernels (forward and backward), and the minicpm4 layers' dense causal attention runs
SDPA on KV heads repeated to the query heads (so the flash kernel applies). Everything else is
``salaquant.model``'s own code, so a checkpoint trained this way is read back by ``salaquant.model`` unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from salaquant.io.writer import save_state_dict
from salaquant.model import attention as attention_module
from salaquant.model.attention import LightningAttention
from salaquant.model.config import DEFAULT_SPARSE_CONFIG, SalaConfig
from salaquant.model.modeling import SalaForCausalLM
from salaquant.model.tiny import preset_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_SHARD_BYTES = 15 * 10**6
MAX_MODEL_BYTES = 28 * 2**20
"""The checkpoint's bound: small enough that the repository with both shipped models stays well under 64 MiB."""


def small_config(vocab_size: int = 4096) -> dict[str, Any]:
    """The sala-small ``config.json`` (the real format: the published config with the sizes changed): the package's
    ``small`` preset (8 layers, minicpm4 first and last, hidden 256, 4 lightning heads, one end-of-sequence id),
    with head_dim 128 everywhere, 8 query heads over 2 KV heads, intermediate 768, 32K positions and the real
    ``sparse_config``."""
    cfg = preset_config("small", vocab_size=vocab_size)
    cfg.update(
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        lightning_head_dim=128,
        max_position_embeddings=32768,
        sparse_config=dict(DEFAULT_SPARSE_CONFIG),
    )
    return cfg


def fla_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    out_dtype: torch.dtype = torch.float32,
    in_place: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``salaquant.model.gla.simple_gla``'s signature on fla-core's chunk kernels (bf16 inputs, fp32 accumulation,
    differentiable). Training only: the state is never updated in place."""
    from fla.ops.simple_gla import chunk_simple_gla

    if in_place:
        raise ValueError("the training path keeps no cache")
    dt = torch.bfloat16
    o, final = chunk_simple_gla(
        q.to(dt),
        k.to(dt),
        v.to(dt),
        g_gamma=g_gamma.float(),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(out_dtype), final


def flash_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of equal-length q ``[B, T, Hq, D]`` and k, v ``[B, T, Hkv, D]`` with the KV heads
    repeated (query head ``h`` reads KV head ``h // G``, as ``dense_causal_attention``), so SDPA runs flash."""
    if q.shape[1] != k.shape[1]:
        raise ValueError("the training path attends whole sequences only")
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale).transpose(1, 2)


def use_fast_path(model: SalaForCausalLM) -> None:
    """Bind fla's GLA to every lightning layer and the flash causal attention to the minicpm4 layers' dense mode
    (the attention function is looked up in ``salaquant.model.attention`` at call time)."""
    for module in model.modules():
        if isinstance(module, LightningAttention):
            module.gla_fn = fla_simple_gla
    attention_module.dense_causal_attention = flash_causal_attention


def use_reference_path(model: SalaForCausalLM) -> None:
    """Undo ``use_fast_path``: the model's own PyTorch GLA and attention."""
    from salaquant.model.gla import simple_gla

    for module in model.modules():
        if isinstance(module, LightningAttention):
            module.gla_fn = simple_gla
    attention_module.dense_causal_attention = _REFERENCE_ATTENTION


_REFERENCE_ATTENTION = attention_module.dense_causal_attention


def write_checkpoint(model: SalaForCausalLM, out: Path, tokenizer_dir: Path) -> Path:
    """The bf16 checkpoint in the real format: sharded safetensors (no shard above ``MAX_SHARD_BYTES``),
    ``config.json``, ``generation_config.json`` and the tokenizer files."""
    if out.exists():
        clear_previous(out)
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    raw = model.config.to_dict()
    raw["architectures"] = ["MiniCPMSALAForCausalLM"]
    save_state_dict(state, out, raw, max_shard_bytes=MAX_SHARD_BYTES)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


SUMMARY = "train_summary.json"
WRITTEN = ("config.json", "generation_config.json", "model.safetensors.index.json", SUMMARY, *TOKENIZER_FILES)


def clear_previous(out: Path) -> None:
    """Remove a checkpoint an earlier call wrote to ``out`` (it holds ``train_summary.json`` and nothing but what
    ``write_checkpoint`` and the training tool write), so that every call can write the same folder; any other
    folder is refused, never emptied."""
    entries = list(out.iterdir())
    shard = re.compile(r"model[-\w]*\.safetensors")
    ours = [p for p in entries if p.is_file() and (p.name in WRITTEN or shard.fullmatch(p.name))]
    if not (out / SUMMARY).is_file() or len(ours) != len(entries):
        others = sorted(p.name for p in entries if p not in ours)
        raise SystemExit(f"{out} is not a checkpoint this tool wrote ({', '.join(others[:4]) or 'no ' + SUMMARY}): "
                         "choose another --out")  # fmt: skip
    for p in ours:
        p.unlink()
    out.rmdir()


def build_model(vocab_size: int = 4096) -> SalaForCausalLM:
    return SalaForCausalLM(SalaConfig.from_dict(small_config(vocab_size)))
