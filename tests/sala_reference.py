"""An independent, deliberately plain MiniCPM-SALA forward pass for tests.

Written straight from the architecture notes with explicit loops and no code shared with
``salaquant.model``: a raw state dict and a raw config dict in, fp32 logits out (dense attention only).
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = (x.float() ** 2).mean(-1, keepdim=True)
    return (x.float() / torch.sqrt(var + eps)).to(x.dtype) * w


def _rope_rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, D]: rotate each pair (i, i + D/2) by angle pos * theta^(-2i/D), as complex numbers."""
    t, _, d = x.shape
    half = d // 2
    xf = x.float()
    z = torch.complex(xf[..., :half], xf[..., half:])
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * freq[None, :]
    rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)[:, None, :]
    z = z * rot
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def _alibi(n: int) -> list[float]:
    def pow2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + pow2(2 * c)[0::2][: n - c]


def _softmax_attention(q, k, v, group: int) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]; explicit causal softmax per head, fp32."""
    t, hq, d = q.shape
    out = torch.zeros(t, hq, d)
    for h in range(hq):
        kv = h // group
        s = q[:, h].float() @ k[:, kv].float().T / math.sqrt(d)
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, kv].float()
    return out


def _gla(q, k, v, slopes: list[float], scale: float) -> torch.Tensor:
    """Token-by-token S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t (fp32)."""
    t, h, d = q.shape
    out = torch.zeros(t, h, v.shape[-1])
    for head in range(h):
        s = torch.zeros(d, v.shape[-1])
        decay = math.exp(-slopes[head])
        for i in range(t):
            s = decay * s + torch.outer(k[i, head].float(), v[i, head].float())
            out[i, head] = scale * (q[i, head].float() @ s)
    return out


def reference_logits(state: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] for one sequence of token ids [T] (dense attention)."""
    eps = cfg["rms_norm_eps"]
    n_layers = cfg["num_hidden_layers"]
    res = cfg["scale_depth"] / math.sqrt(n_layers)
    x = state["model.embed_tokens.weight"][ids] * cfg["scale_emb"]
    t = ids.shape[0]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        hn = _rms(x, state[p + "input_layernorm.weight"], eps)

        def lin(name: str, inp: torch.Tensor, p: str = p) -> torch.Tensor:
            return inp @ state[p + name + ".weight"].T

        if cfg["mixer_types"][i] == "minicpm4":
            hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            q = lin("self_attn.q_proj", hn).view(t, hq, d)
            k = lin("self_attn.k_proj", hn).view(t, hkv, d)
            v = lin("self_attn.v_proj", hn).view(t, hkv, d)
            if cfg["attn_use_rope"]:
                q, k = _rope_rotate(q, cfg["rope_theta"]), _rope_rotate(k, cfg["rope_theta"])
            a = _softmax_attention(q, k, v, hq // hkv).to(x.dtype).reshape(t, hq * d)
            a = a * torch.sigmoid(lin("self_attn.o_gate", hn))
            a = lin("self_attn.o_proj", a)
        else:
            h, d = cfg["lightning_nh"], cfg["lightning_head_dim"]
            q = lin("self_attn.q_proj", hn).view(t, h, d)
            k = lin("self_attn.k_proj", hn).view(t, h, d)
            v = lin("self_attn.v_proj", hn).view(t, h, d)
            q = _rms(q, state[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, state[p + "self_attn.k_norm.weight"], eps)
            q, k = _rope_rotate(q, cfg["rope_theta"]), _rope_rotate(k, cfg["rope_theta"])
            o = _gla(q, k, v, _alibi(h), d**-0.5).to(x.dtype).reshape(t, h * d)
            o = _rms(o, state[p + "self_attn.o_norm.weight"], eps)
            o = o * torch.sigmoid(lin("self_attn.z_proj", hn))
            a = lin("self_attn.o_proj", o)
        x = x + a * res
        hn = _rms(x, state[p + "post_attention_layernorm.weight"], eps)
        gate = lin("mlp.gate_proj", hn)
        m = lin("mlp.down_proj", gate * torch.sigmoid(gate) * lin("mlp.up_proj", hn))
        x = x + m * res
    x = _rms(x, state["model.norm.weight"], eps)
    x = x / (cfg["hidden_size"] / cfg["dim_model_base"])
    return (x @ state["lm_head.weight"].T).float()
