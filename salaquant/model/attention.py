"""The two token mixers of MiniCPM-SALA.

* ``SparseAttention`` (mixer ``minicpm4``): GQA softmax attention (no RoPE in the public checkpoint),
  dense, forced dense, or InfLLM-v2 block-sparse from ``dense_len`` on, then ``x sigmoid(o_gate(x))``
  and ``o_proj``.
* ``LightningAttention`` (mixer ``lightning``): per-head q/k RMSNorm, NeoX RoPE in fp32, Simple GLA in
  fp32 with ``g_gamma = -ALiBi slopes``, ``o_norm``, ``x sigmoid(z_proj(x))``, ``o_proj``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import LightningLayerCache, SparseLayerCache
from .config import SalaConfig
from .gla import alibi_slopes, simple_gla
from .kv_cache_dtype import stored
from .layers import RMSNorm, apply_rope, fused_outputs
from .sparse_attention import SparseParams, compress_keys, extend_compressed, infllm_v2_attention
from .static_cache import StaticLightningCache, StaticSparseCache, decode_attention

RopeTables = tuple[torch.Tensor, torch.Tensor]


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention. q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; queries are the last Tq positions.

    Chunked prefill (1 < Tq < Tk) uses a lower-right-aligned causal bias, which SDPA runs without
    materialising a [Tq, Tk] mask; K/V are never repeated across the query heads of a group.
    """
    tq, tk = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    if tq == tk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif tq == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    else:
        from torch.nn.attention.bias import causal_lower_right  # here: importing it imports triton

        bias = causal_lower_right(tq, tk)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


SparseCache = SparseLayerCache | StaticSparseCache | None
"""What a minicpm4 layer's ``cache`` may be: prefill/eval's growing cache, the runtime's static one, or none."""
LightningCache = LightningLayerCache | StaticLightningCache | None
"""What a lightning layer's ``cache`` may be."""


def project_qkv(attn: nn.Module, x: torch.Tensor, *extra: str) -> list[torch.Tensor]:
    """q ``[B, T, num_heads, head_dim]``, k and v ``[B, T, num_kv_heads, head_dim]`` (the sizes of ``attn``) of
    ``x`` ``[B, T, *]``, then the outputs of the ``extra`` linears of the same input (fused or not:
    ``fused_outputs``), each contiguous, so that no cache or later use keeps a whole fused product alive."""
    b, t, _ = x.shape
    q, k, v, *rest = [p.contiguous() for p in fused_outputs(attn, x, ("q_proj", "k_proj", "v_proj", *extra))]
    kv_shape = (b, t, attn.num_kv_heads, attn.head_dim)
    return [q.view(b, t, attn.num_heads, attn.head_dim), k.view(kv_shape), v.view(kv_shape), *rest]


class _Mixer(nn.Module):
    """What both layer mixers share: the q/k/v/o projections, and around the mixing: q/k/v and the output gate's
    input from one projection of ``x``, q/k norms and RoPE where the layer uses them, then the gate (``sigmoid``)
    and ``o_proj`` on the mixed heads. ``mix`` (each mixer's) takes q ``[B, T, num_heads, head_dim]`` and k/v
    ``[B, T, num_kv_heads, head_dim]`` and returns ``[B, T, num_heads * head_dim]`` in ``x``'s dtype."""

    gate_name: str  # the output gate's linear
    use_qk_norm: bool
    use_rope: bool

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, use_gate: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.use_gate = use_gate
        if use_gate:
            self.add_module(self.gate_name, nn.Linear(hidden, num_heads * head_dim, bias=False))

    def mix(self, q: Tensor, k: Tensor, v: Tensor, cache: Any, mode: str, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, rope: RopeTables | None, cache: Any = None, mode: str = "auto") -> torch.Tensor:
        q, k, v, *gate = project_qkv(self, x, *((self.gate_name,) if self.use_gate else ()))
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            assert rope is not None
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.mix(q, k, v, cache, mode, x.dtype)
        if self.use_gate:
            out = out * torch.sigmoid(gate[0])
        return self.o_proj(out)


class SparseAttention(_Mixer):
    """minicpm4 layer mixer. ``mode``: "auto" (sparse when the total length reaches dense_len),
    "dense" (forced dense: the calibration switch) or "sparse" (always InfLLM-v2)."""

    gate_name = "o_gate"

    def __init__(self, config: SalaConfig) -> None:
        c = config
        super().__init__(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attn_use_output_gate
        )
        self.use_rope = config.attn_use_rope
        self.use_qk_norm = False  # SALA's minicpm4 layers have no q/k norms
        self.rope_theta = config.rope_theta
        self.dense_len = config.dense_len
        self.sparse = SparseParams.from_config(config.sparse_config) if config.sparse_config is not None else None
        self.sparse_fn = infllm_v2_attention  # the reference; the runtime binds a backend (use_layer_kernels)
        self.decode_backend = "reference"  # static-cache decode attention; the runtime sets it too
        self.kv_cache_dtype = "bf16"  # how the KV cache stores keys and values (``kv_cache_dtype.stored``)

    def use_sparse(self, total_len: int, mode: str) -> bool:
        if mode == "dense":
            return False
        if self.sparse is None:
            if mode == "sparse":
                raise ValueError("attention mode 'sparse' needs a sparse_config in config.json")
            return False
        if mode == "sparse":
            return True
        assert self.dense_len is not None
        return total_len >= self.dense_len

    def mix(self, q: Tensor, k: Tensor, v: Tensor, cache: SparseCache, mode: str, dtype: torch.dtype) -> Tensor:
        b, t = q.shape[:2]
        if self.kv_cache_dtype != "bf16":  # what an FP8 cache gives back (the keys after RoPE, as stored)
            k, v = stored(k, self.kv_cache_dtype), stored(v, self.kv_cache_dtype)
        scale = self.head_dim**-0.5
        if isinstance(cache, StaticSparseCache):
            out = decode_attention(q, k, v, cache, self.sparse, self.dense_len, mode, self.decode_backend)
        else:
            out = self._attend(q, k, v, cache, mode, scale)
        return out.reshape(b, t, self.num_heads * self.head_dim).to(dtype)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SparseLayerCache | None, mode: str, scale: float
    ) -> torch.Tensor:
        if cache is not None:
            k, v = cache.append(k, v)
        if self.use_sparse(k.shape[1], mode):
            assert self.sparse is not None
            k1 = k2 = None
            if cache is not None:
                p = self.sparse
                cache.k1 = (
                    compress_keys(k, p.kernel_size, p.kernel_stride)
                    if cache.k1 is None
                    else extend_compressed(k, cache.k1, p.kernel_size, p.kernel_stride)
                )
                cache.k2 = (
                    compress_keys(k, p.kernel_size2, p.kernel_stride2)
                    if cache.k2 is None
                    else extend_compressed(k, cache.k2, p.kernel_size2, p.kernel_stride2)
                )
                k1, k2 = cache.k1, cache.k2
            return self.sparse_fn(q, k, v, self.sparse, k1=k1, k2=k2)
        return dense_causal_attention(q, k, v, scale)


class LightningAttention(_Mixer):
    """lightning layer mixer (Simple GLA with fixed per-head decay)."""

    gate_name = "z_proj"

    def __init__(self, config: SalaConfig) -> None:
        c, d = config, config.lightning_head_dim
        super().__init__(c.hidden_size, c.lightning_nh, c.lightning_nkv, d, c.use_output_gate)
        self.scale = config.lightning_scale
        self.use_rope = config.lightning_use_rope
        self.use_qk_norm = config.qk_norm
        self.use_out_norm = config.use_output_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        if self.use_out_norm:
            self.o_norm = RMSNorm(self.num_heads * d, config.rms_norm_eps)
        self.gla_fn = simple_gla  # the reference; the runtime binds a backend (use_layer_kernels)
        self._decay: dict[torch.device, torch.Tensor] = {}

    def _g_gamma(self, device: torch.device) -> torch.Tensor:
        """``-alibi_slopes(H)`` on ``device``, made once (a host-to-device copy per call could not be captured in a
        CUDA graph)."""
        if device not in self._decay:
            self._decay[device] = -alibi_slopes(self.num_heads).to(device)
        return self._decay[device]

    def mix(self, q: Tensor, k: Tensor, v: Tensor, cache: LightningCache, mode: str, dtype: torch.dtype) -> Tensor:
        b, t = q.shape[:2]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
        state = cache.state if cache is not None else None
        static = isinstance(cache, StaticLightningCache)
        # computed in fp32 from the activations' values (both backends of simple_gla upcast 16-bit inputs as
        # they read them, without fp32 copies); a static cache's state buffer is updated in place
        o, final = self.gla_fn(
            q,
            k,
            v,
            self._g_gamma(q.device),
            self.scale,
            initial_state=state,
            output_final_state=cache is not None,
            out_dtype=dtype,
            in_place=static,
        )
        if cache is not None and not static:
            cache.state = final
        o = o.to(dtype).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_norm(o) if self.use_out_norm else o
