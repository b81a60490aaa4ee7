"""Fixed-shape decode state, so that a decode step has the same tensors every step and a CUDA graph can replay it.

``StaticCache`` holds, for ``B`` rows and ``capacity`` positions, every minicpm4 layer's keys and values and its
compressed K1/K2 windows (``StaticSparseCache``), every lightning layer's GLA state (``StaticLightningCache``,
updated in place) and the tokens held per row (``lengths``, on the device). Rows may hold different lengths:
row ``b``'s next token sits at position ``lengths[b]``, which its RoPE and its attention mask follow.

``decode_attention`` is the minicpm4 attention of one new token per row on that state, without a host read:

* the new key and value are written at ``lengths[b]``, and a K1 / K2 window that the new key completes is
  mean-pooled into its slot (the windows ``compress_keys`` makes, computed as it does: fp32 sum, one rounding);
* a row attends to its ``lengths[b] + 1`` keys, dense, or, in the sparse regime (``mode`` ``"sparse"``, or
  ``"auto"`` from ``dense_len`` keys on, decided per row), to the keys of the blocks InfLLM-v2 selects: the
  stage-1 scores, block max-pooling, forced init and local blocks and the stable top-k of
  ``sparse_attention`` with the row's own position. Blocks beyond the row's last one score ``-inf``, so the
  top-k over the buffer's blocks keeps exactly the blocks the reference keeps from the row's own.

The attention itself is one masked softmax over the buffer (its G query heads per KV head as G queries), in fp32:
the same function as the reference's masked attention over the chosen keys. Here it is two fp32 batched matrix
products around the softmax; the runtime's Triton path (``backend``) splits the keys over the GPU instead
(``kernels.decode_attention``), since one program per head (PyTorch's fused attention on this shape) or a GEMV over
the keys leaves most of the GPU idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels.backend import use_triton
from .cache import LightningLayerCache, SalaCache, SparseLayerCache
from .config import LIGHTNING, SalaConfig
from .sparse_attention import SparseParams, compress_keys, forced_blocks, num_compressed


@dataclass
class StaticSparseCache:
    """A minicpm4 layer's keys/values ``[B, C, Hkv, D]`` and compressed windows ``[B, n(C), Hkv, D]``."""

    k: Tensor
    v: Tensor
    k1: Tensor | None
    k2: Tensor | None
    lengths: Tensor  # [B] int64, the StaticCache's own


class StaticLightningCache:
    """A lightning layer's GLA state ``[B, H, K, V]`` fp32; assigning ``state`` copies into the buffer."""

    def __init__(self, state: Tensor) -> None:
        self._state = state

    @property
    def state(self) -> Tensor:
        return self._state

    @state.setter
    def state(self, value: Tensor) -> None:
        self._state.copy_(value)


@dataclass
class StaticCache:
    layers: list[StaticSparseCache | StaticLightningCache] = field(default_factory=list)
    lengths: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    capacity: int = 0
    sparse: SparseParams | None = None

    @classmethod
    def allocate(
        cls, config: SalaConfig, batch: int, capacity: int, device: torch.device | str, dtype: torch.dtype
    ) -> StaticCache:
        """Zeroed buffers for ``batch`` rows of ``capacity`` positions (at least one K2 window's worth, so that the
        pooling of a window's keys always reads inside the buffer)."""
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        sparse = SparseParams.from_config(config.sparse_config) if config.sparse_config is not None else None
        if sparse is not None:
            capacity = max(capacity, sparse.kernel_size2)
        layers: list[StaticSparseCache | StaticLightningCache] = []
        for kind in config.mixer_types:
            if kind == LIGHTNING:
                h, d = config.lightning_nh, config.lightning_head_dim
                layers.append(StaticLightningCache(torch.zeros(batch, h, d, d, dtype=torch.float32, device=device)))
                continue
            shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
            k1 = k2 = None
            if sparse is not None:
                n1 = max(1, num_compressed(capacity, sparse.kernel_size, sparse.kernel_stride))
                n2 = max(1, num_compressed(capacity, sparse.kernel_size2, sparse.kernel_stride2))
                k1 = torch.zeros(batch, n1, *shape[2:], dtype=dtype, device=device)
                k2 = torch.zeros(batch, n2, *shape[2:], dtype=dtype, device=device)
            layers.append(
                StaticSparseCache(
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                    k1,
                    k2,
                    lengths,
                )
            )
        return cls(layers, lengths, capacity, sparse)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def positions(self, t: int, device: torch.device) -> Tensor:
        """``[B, t]`` positions of the next ``t`` tokens of each row."""
        return self.lengths[:, None] + torch.arange(t, device=device)

    def advance(self, t: int) -> None:
        self.lengths += t

    def reset(self) -> None:
        """Every row empty (keys beyond a row's length are never read, so only the GLA states are zeroed)."""
        self.lengths.zero_()
        for entry in self.layers:
            if isinstance(entry, StaticLightningCache):
                entry.state.zero_()

    def load_row(self, dst: int, cache: SalaCache, src: int) -> None:
        """Copy row ``src`` of a prefilled ``SalaCache`` into row ``dst`` of this cache (compressed windows
        built from its keys as ``compress_keys`` builds them)."""
        sparse = self.sparse
        n = cache.seen_tokens
        if n > self.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit a cache of {self.capacity} positions")
        for into, entry in zip(self.layers, cache.layers, strict=True):
            if isinstance(into, StaticLightningCache):
                assert isinstance(entry, LightningLayerCache) and entry.state is not None
                into.state[dst] = entry.state[src]
                continue
            assert isinstance(entry, SparseLayerCache) and entry.k is not None and entry.v is not None
            into.k[dst, :n] = entry.k[src]
            into.v[dst, :n] = entry.v[src]
            if sparse is not None and into.k1 is not None and into.k2 is not None:
                for buf, ks, st in ((into.k1, sparse.kernel_size, sparse.kernel_stride),
                                    (into.k2, sparse.kernel_size2, sparse.kernel_stride2)):  # fmt: skip
                    windows = compress_keys(entry.k[src : src + 1], ks, st)[0]
                    buf[dst, : windows.shape[0]] = windows
        self.lengths[dst] = n


def _write_window(buf: Tensor, k: Tensor, lengths: Tensor, kernel: int, stride: int) -> None:
    """Pool the window that the key at ``lengths - 1`` completes (if it completes one) into its slot of ``buf``."""
    rows = torch.arange(k.shape[0], device=k.device)
    start = (lengths - kernel).clamp(min=0)
    complete = (lengths >= kernel) & ((lengths - kernel) % stride == 0)
    slot = (start // stride).clamp(max=buf.shape[1] - 1)
    window = k[rows[:, None], start[:, None] + torch.arange(kernel, device=k.device)]  # [B, kernel, Hkv, D]
    pooled = window.float().mean(dim=1).to(buf.dtype)
    buf[rows, slot] = torch.where(complete[:, None, None], pooled, buf[rows, slot])


def _selected_keys(q: Tensor, cache: StaticSparseCache, pos: Tensor, p: SparseParams) -> Tensor:
    """``[B, Hkv, C]``: whether each key of the buffer lies in a block InfLLM-v2 selects for the row's query at
    ``pos`` (its query heads grouped by KV head)."""
    assert cache.k1 is not None and cache.k2 is not None
    b, _, hq, d = q.shape
    cap, hkv = cache.k.shape[1], cache.k.shape[2]
    dev = q.device
    scale = 1.0 / math.sqrt(d)
    qg = q[:, 0].reshape(b, hkv, hq // hkv, d).float()  # [B, Hkv, G, D]
    end1 = p.kernel_stride * torch.arange(cache.k1.shape[1], device=dev) + p.kernel_size - 1
    end2 = p.kernel_stride2 * torch.arange(cache.k2.shape[1], device=dev) + p.kernel_size2 - 1
    vis2 = end2[None, :] <= pos[:, None]  # [B, n2]
    logits2 = _window_logits(qg, cache.k2) * scale
    lse = torch.logsumexp(logits2.masked_fill(~vis2[:, None, None], -math.inf), dim=-1, keepdim=True)
    has_k2 = vis2.any(dim=-1)  # [B]
    lse = torch.where(has_k2[:, None, None, None], lse, 0.0)
    vis1 = (end1[None, :] <= pos[:, None]) & has_k2[:, None]  # [B, n1]
    logits1 = _window_logits(qg, cache.k1) * scale
    scores = torch.exp(logits1 - lse).masked_fill(~vis1[:, None, None], 0.0).sum(dim=2)  # [B, Hkv, n1]

    r = p.pool_ratio
    n_blocks = -(-cap // p.block_size)
    padded = scores.new_full((b, hkv, r * n_blocks + 1), -math.inf)
    used = min(scores.shape[-1], r * n_blocks)
    padded[..., 1 : 1 + used] = scores[..., :used]
    pooled = padded.unfold(-1, r + 1, r).amax(dim=-1)  # [B, Hkv, n_blocks]
    pooled = torch.where(torch.isneginf(pooled), 0.0, pooled)
    blocks = torch.arange(n_blocks, device=dev)
    qb = (pos // p.block_size)[:, None, None]  # [B, 1, 1]
    pooled = pooled.masked_fill(forced_blocks(blocks, qb, p), math.inf)
    pooled = pooled.masked_fill(blocks > qb, -math.inf)  # blocks the row has not reached
    chosen = top_blocks(pooled, p.total_topk) & (blocks <= qb)
    key_block = torch.arange(cap, device=dev) // p.block_size
    return chosen[..., key_block]


def top_blocks(scores: Tensor, k: int) -> Tensor:
    """Whether each of the last dimension's entries is among its ``k`` first in a stable descending sort (ties
    go to the lower index), as a rank per entry: how many entries are ahead of it. The same choice as sorting, in
    one reduction the compiler fuses, where a sort of a row's few hundred blocks ran in one slow program."""
    idx = torch.arange(scores.shape[-1], device=scores.device)
    above = scores[..., None, :] > scores[..., :, None]  # [..., entry, other]
    tied_before = (scores[..., None, :] == scores[..., :, None]) & (idx[None, :] < idx[:, None])
    return (above | tied_before).sum(dim=-1) < k


def _window_logits(qg: Tensor, windows: Tensor) -> Tensor:
    """``[B, Hkv, G, n]`` fp32 products of the grouped queries ``qg [B, Hkv, G, D]`` with the compressed windows
    ``[B, n, Hkv, D]``. Inside ``torch.compile`` as a broadcast product summed over ``D``, which the compiler makes
    one reduction fused with the fp32 conversion (a matrix product would be a library call on a [G x n] problem per
    KV head); eagerly as ``einsum``, which does not hold the ``[B, Hkv, G, n, D]`` product in memory."""
    if torch.compiler.is_compiling():
        return (qg[:, :, :, None, :] * windows.permute(0, 2, 1, 3)[:, :, None].float()).sum(dim=-1)
    return torch.einsum("bhgd,bnhd->bhgn", qg, windows.float())


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: StaticSparseCache,
    params: SparseParams | None,
    dense_len: int | None,
    mode: str,
    backend: str = "reference",
) -> Tensor:
    """Attention output ``[B, 1, Hq, D]`` of one new token per row (``q [B, 1, Hq, D]``, ``k, v [B, 1, Hkv, D]``),
    after storing its key and value in ``cache``. ``backend`` (``kernels.backend.use_triton``) runs the masked
    softmax here or in the split-key kernel of ``kernels.decode_attention``."""
    if q.shape[1] != 1:
        raise ValueError(f"a static cache decodes one token per row, got {q.shape[1]}")
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    rows = torch.arange(b, device=q.device)
    pos = cache.lengths
    cache.k[rows, pos] = k[:, 0]
    cache.v[rows, pos] = v[:, 0]
    cap = cache.k.shape[1]
    visible = torch.arange(cap, device=q.device)[None, :] <= pos[:, None]  # [B, C]
    mask = visible[:, None, :].expand(b, hkv, cap)
    if params is not None and mode != "dense":
        assert cache.k1 is not None and cache.k2 is not None
        _write_window(cache.k1, cache.k, pos + 1, params.kernel_size, params.kernel_stride)
        _write_window(cache.k2, cache.k, pos + 1, params.kernel_size2, params.kernel_stride2)
        sparse_rows = torch.ones_like(visible[:, 0]) if mode == "sparse" else (pos + 1) >= (dense_len or 0)
        chosen = _selected_keys(q, cache, pos, params) & visible[:, None, :]
        mask = torch.where(sparse_rows[:, None, None], chosen, mask)
    if use_triton(backend, q, cache.k):
        from ..kernels.decode_attention import masked_decode_attention

        out = masked_decode_attention(q[:, 0].reshape(b, hkv, hq // hkv, d), cache.k, cache.v, mask, d**-0.5)
        return out.reshape(b, 1, hq, d)
    qg = q[:, 0].reshape(b, hkv, hq // hkv, d).float()  # a KV head's G query heads as G queries
    scores = torch.matmul(qg, cache.k.transpose(1, 2).float().transpose(-1, -2)) * d**-0.5  # [B, Hkv, G, C]
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None, :], -math.inf), dim=-1)
    out = torch.matmul(probs, cache.v.transpose(1, 2).float())
    return out.to(q.dtype).reshape(b, 1, hq, d)
