"""InfLLM-v2 block-sparse attention reference in plain PyTorch (the ``minicpm4`` layers of SALA).

Shapes: ``q: [B, Tq, Hq, D]``; ``k, v: [B, Tk, Hkv, D]`` hold every key including the cache. Query ``i``
sits at absolute position ``t = q_start + i`` with ``q_start = Tk - Tq``. ``G = Hq // Hkv`` query heads
share a KV head (query head ``h`` uses KV head ``h // G``). The softmax scale is ``1 / sqrt(D)``.

Pipeline:

1. Compress keys by mean pooling full windows: K1 with ``(kernel_size, kernel_stride)``, K2 with
   ``(4 * kernel_size, 4 * kernel_stride)``.
2. Stage-1 scores: per KV group, the sum over its query heads of ``exp(scale * q . K1_i - LSE)``, where
   ``LSE`` is the log-sum-exp of ``scale * q . K2_j`` over the visible K2 windows.
3. Max-pool the scores into ``block_size``-token blocks; force init and local blocks to ``+inf``.
4. Keep the top ``topk + window_size // block_size`` blocks per (query, KV head); future blocks -> ``-1``.
5. Causal attention over the keys of the selected blocks only.

All scoring math runs in fp32. ``infllm_v2_attention`` runs this reference or, by its ``backend``, the Triton
kernels of ``salaquant.kernels.infllm`` (imported only then), which compute the same pipeline.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..kernels.backend import use_triton
from .config import DEFAULT_SPARSE_CONFIG

__all__ = [
    "SparseParams",
    "block_scores",
    "block_sparse_attention",
    "compress_keys",
    "drop_forced_blocks",
    "extend_compressed",
    "forced_blocks",
    "infllm_v2_attention",
    "num_compressed",
    "select_blocks",
    "stage1_scores",
]

K2_FACTOR = 4
"""K2 uses ``kernel_size * 4`` and ``kernel_stride * 4``."""


@dataclass(frozen=True)
class SparseParams:
    """InfLLM-v2 sparse attention settings; the defaults are SALA's ``sparse_config`` (``DEFAULT_SPARSE_CONFIG``)."""

    kernel_size: int = DEFAULT_SPARSE_CONFIG["kernel_size"]
    kernel_stride: int = DEFAULT_SPARSE_CONFIG["kernel_stride"]
    init_blocks: int = DEFAULT_SPARSE_CONFIG["init_blocks"]
    block_size: int = DEFAULT_SPARSE_CONFIG["block_size"]
    window_size: int = DEFAULT_SPARSE_CONFIG["window_size"]
    topk: int = DEFAULT_SPARSE_CONFIG["topk"]

    def __post_init__(self) -> None:
        for name in ("kernel_size", "kernel_stride", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("init_blocks", "window_size", "topk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size % self.kernel_stride != 0:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of kernel_stride ({self.kernel_stride})"
            )

    @property
    def local_blocks(self) -> int:
        """Number of blocks before the query's own block that are always selected."""
        return self.window_size // self.block_size

    @property
    def total_topk(self) -> int:
        """Blocks selected per (query, KV head): ``topk + local_blocks``."""
        return self.topk + self.local_blocks

    @property
    def keeps_forced_blocks(self) -> bool:
        """Whether every row's selection holds all its forced blocks (init blocks, local window and own block)."""
        return self.total_topk >= self.init_blocks + self.local_blocks + 1

    @property
    def kernel_size2(self) -> int:
        """K2 window length."""
        return self.kernel_size * K2_FACTOR

    @property
    def kernel_stride2(self) -> int:
        """K2 window stride."""
        return self.kernel_stride * K2_FACTOR

    @property
    def pool_ratio(self) -> int:
        """K1 windows per block: ``block_size // kernel_stride``."""
        return self.block_size // self.kernel_stride

    @classmethod
    def from_config(cls, sparse_config: Mapping[str, Any]) -> "SparseParams":
        """Build from a HF ``sparse_config`` dict; missing keys keep defaults, unrelated keys are ignored."""
        kwargs = {
            name: int(sparse_config[name])
            for name in ("kernel_size", "kernel_stride", "init_blocks", "block_size", "window_size", "topk")
            if sparse_config.get(name) is not None
        }
        return cls(**kwargs)


def num_compressed(seq_len: int, kernel_size: int, stride: int) -> int:
    """Number of full windows ``[stride * i, stride * i + kernel_size)`` inside ``seq_len`` tokens."""
    if seq_len < kernel_size:
        return 0
    return (seq_len - kernel_size) // stride + 1


def compress_keys(k: Tensor, kernel_size: int, stride: int) -> Tensor:
    """Mean-pool full key windows: ``out[:, i] = mean(k[:, stride*i : stride*i + kernel_size])``.

    ``k: [B, Tk, Hkv, D]`` -> ``[B, n, Hkv, D]`` in ``k.dtype``: summed in fp32 and rounded once, as the model's
    own ``filtered_k.mean(dim=1)`` does for bf16 keys, so stage 1 scores the same bf16 compressed keys the
    model's kernel takes (and runs bf16 tensor-core dots instead of TF32 ones).
    """
    b, tk, h, d = k.shape
    n = num_compressed(tk, kernel_size, stride)
    if n == 0:
        return k.new_zeros(b, 0, h, d)
    windows = k.float().unfold(1, kernel_size, stride)  # [B, n, H, D, kernel_size]
    return windows.mean(dim=-1).to(k.dtype)


def extend_compressed(k_full: Tensor, compressed: Tensor, kernel_size: int, stride: int) -> Tensor:
    """Append the windows completed since ``compressed`` was built from a prefix of ``k_full``.

    The result equals ``compress_keys(k_full, kernel_size, stride)``, in ``compressed.dtype``.
    """
    n_have = compressed.shape[1]
    n_total = num_compressed(k_full.shape[1], kernel_size, stride)
    if n_have > n_total:
        raise ValueError(f"compressed has {n_have} windows but k_full only allows {n_total}")
    if n_have == n_total:
        return compressed
    begin = stride * n_have
    end = stride * (n_total - 1) + kernel_size
    new = compress_keys(k_full[:, begin:end], kernel_size, stride)
    return torch.cat([compressed, new.to(compressed.dtype)], dim=1)


def _group_queries(q: Tensor, num_kv_heads: int) -> Tensor:
    """``[B, Tq, Hq, D]`` -> ``[B, Hkv, G, Tq, D]`` (head ``h`` -> group ``h // G``)."""
    b, tq, hq, d = q.shape
    if hq % num_kv_heads != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({num_kv_heads})")
    return q.reshape(b, tq, num_kv_heads, hq // num_kv_heads, d).permute(0, 2, 3, 1, 4)


def stage1_scores(
    q: Tensor,
    k1: Tensor,
    k2: Tensor,
    q_start: int,
    params: SparseParams,
    query_chunk: int = 512,
) -> Tensor:
    """Stage-1 block-relevance scores ``[B, Hkv, Tq, n1]`` (fp32).

    For a query at position ``t`` and query head ``h``::

        LSE_h(t)    = logsumexp_j scale * q_h . K2_j     over j with stride2 * j + kernel2 - 1 <= t
        score[g,t,i] = sum_{h in group g} exp(scale * q_h . K1_i - LSE_h(t))
                                                          over i with stride * i + kernel - 1 <= t

    Invisible K1 windows score 0. Rows with no visible K2 window (``t < kernel2 - 1``) are all 0.
    Queries are processed ``query_chunk`` at a time.
    """
    b, tq, _, d = q.shape
    hkv = k1.shape[2]
    n1, n2 = k1.shape[1], k2.shape[1]
    scale = 1.0 / math.sqrt(d)
    device = q.device
    qg = _group_queries(q, hkv).float()  # [B, Hkv, G, Tq, D]
    k1t = k1.float().permute(0, 2, 3, 1)  # [B, Hkv, D, n1]
    k2t = k2.float().permute(0, 2, 3, 1)  # [B, Hkv, D, n2]
    end1 = params.kernel_stride * torch.arange(n1, device=device) + params.kernel_size - 1
    end2 = params.kernel_stride2 * torch.arange(n2, device=device) + params.kernel_size2 - 1
    out = torch.zeros(b, hkv, tq, n1, dtype=torch.float32, device=device)
    for c0 in range(0, tq, query_chunk):
        c1 = min(tq, c0 + query_chunk)
        pos = q_start + torch.arange(c0, c1, device=device)  # [tc]
        qc = qg[:, :, :, c0:c1]  # [B, Hkv, G, tc, D]
        vis2 = end2[None, :] <= pos[:, None]  # [tc, n2]
        logits2 = (qc @ k2t[:, :, None]) * scale  # [B, Hkv, G, tc, n2]
        lse = torch.logsumexp(logits2.masked_fill(~vis2, -math.inf), dim=-1, keepdim=True)
        has_k2 = vis2.any(dim=-1)  # [tc]
        lse = torch.where(has_k2[:, None], lse, 0.0)  # finite placeholder; these rows are zeroed below
        vis1 = (end1[None, :] <= pos[:, None]) & has_k2[:, None]  # [tc, n1]
        logits1 = (qc @ k1t[:, :, None]) * scale  # [B, Hkv, G, tc, n1]
        p = torch.exp(logits1 - lse).masked_fill(~vis1, 0.0)
        out[:, :, c0:c1] = p.sum(dim=2)
    return out


def _query_blocks(q_start: int, tq: int, block_size: int, device: torch.device) -> Tensor:
    return (q_start + torch.arange(tq, device=device)) // block_size


def block_scores(scores: Tensor, q_start: int, tk: int, params: SparseParams) -> Tensor:
    """Max-pool stage-1 scores into blocks: ``[B, Hkv, Tq, n1]`` -> ``[B, Hkv, Tq, ceil(Tk / block_size)]``.

    With ``r = block_size // kernel_stride``, block ``b`` takes the max over K1 indices
    ``[r*b - 1, r*b + r - 1]`` clipped to ``[0, n1)`` (0 if that range is empty). Init blocks
    (``b < init_blocks``) and local blocks (``qb - local_blocks <= b <= qb``, ``qb = t // block_size``)
    are set to ``+inf``.
    """
    bsz, hkv, tq, n1 = scores.shape
    r = params.pool_ratio
    n_blocks = -(-tk // params.block_size)
    if n_blocks == 0:
        return scores.new_zeros(bsz, hkv, tq, 0, dtype=torch.float32)
    length = r * n_blocks + 1  # index 0 of ``padded`` is K1 index -1
    padded = scores.new_full((bsz, hkv, tq, length), -math.inf, dtype=torch.float32)
    used = min(n1, length - 1)
    padded[..., 1 : 1 + used] = scores[..., :used].float()
    pooled = padded.unfold(-1, r + 1, r).amax(dim=-1)  # [B, Hkv, Tq, n_blocks]
    pooled = torch.where(torch.isneginf(pooled), 0.0, pooled)

    blocks = torch.arange(n_blocks, device=scores.device)
    qb = _query_blocks(q_start, tq, params.block_size, scores.device)[:, None]  # [Tq, 1]
    return pooled.masked_fill(forced_blocks(blocks[None, :], qb, params), math.inf)


def forced_blocks(blocks: Tensor, qb: Tensor, params: SparseParams) -> Tensor:
    """Which ``blocks`` a query in block ``qb`` always selects (broadcast): ``b < init_blocks`` or
    ``qb - local_blocks <= b <= qb``."""
    return (blocks < params.init_blocks) | ((blocks >= qb - params.local_blocks) & (blocks <= qb))


def drop_forced_blocks(block_idx: Tensor, q_start: int, params: SparseParams) -> Tensor:
    """``block_idx [B, Hkv, Tq, S]`` without each row's forced blocks, the rest first (descending), trimmed to the
    longest row (int32; rows with nothing left keep one -1): what the Triton stage 2 takes beside the kernel that
    attends the forced blocks."""
    tq = block_idx.shape[2]
    qb = ((q_start + torch.arange(tq, device=block_idx.device)) // params.block_size).view(1, 1, tq, 1)
    blk = block_idx.long()
    rest = torch.where(forced_blocks(blk, qb, params), -1, blk).sort(dim=-1, descending=True).values
    keep = max(1, int((rest >= 0).sum(dim=-1).max())) if rest.numel() else 1
    return rest[..., :keep].to(torch.int32).contiguous()


def select_blocks(block_scores: Tensor, q_start: int, params: SparseParams) -> Tensor:
    """Top ``min(total_topk, n_blocks)`` blocks per row, ``[B, Hkv, Tq, k]`` int64.

    Ranking is score descending with ties broken by lower block index. The chosen indices are sorted
    ascending, then indices of future blocks (``> t // block_size``) are replaced by ``-1``.
    """
    tq, n_blocks = block_scores.shape[-2:]
    k = min(params.total_topk, n_blocks)
    order = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices
    idx = order[..., :k].sort(dim=-1).values
    qb = _query_blocks(q_start, tq, params.block_size, block_scores.device)[:, None]
    return idx.masked_fill(idx > qb, -1)


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_idx: Tensor,
    q_start: int,
    params: SparseParams,
    query_chunk: int = 256,
) -> Tensor:
    """Attention restricted to selected key blocks, ``[B, Tq, Hq, D]`` in ``q.dtype``.

    ``block_idx: [B, Hkv, Tq, S]`` (entries ``-1`` are ignored). Query at position ``t`` attends to keys
    ``s <= t`` whose block ``s // block_size`` is selected for its KV group. Softmax in fp32. A row with no
    key left outputs zeros. Implemented as masked dense attention, ``query_chunk`` queries at a time.
    """
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    device = q.device
    n_blocks = -(-tk // params.block_size)
    qg = _group_queries(q, hkv).float()  # [B, Hkv, G, Tq, D]
    kt = k.float().permute(0, 2, 3, 1)  # [B, Hkv, D, Tk]
    vf = v.float().transpose(1, 2)  # [B, Hkv, Tk, D]
    key_pos = torch.arange(tk, device=device)
    key_block = key_pos // params.block_size
    out = torch.empty(b, hkv, g, tq, d, dtype=torch.float32, device=device)
    for c0 in range(0, tq, query_chunk):
        c1 = min(tq, c0 + query_chunk)
        idx = block_idx[:, :, c0:c1].long()
        # one extra slot swallows -1 and out-of-range entries
        idx = torch.where((idx >= 0) & (idx < n_blocks), idx, n_blocks)
        chosen = torch.zeros(*idx.shape[:3], n_blocks + 1, dtype=torch.bool, device=device)
        chosen.scatter_(-1, idx, True)
        pos = q_start + torch.arange(c0, c1, device=device)
        mask = chosen[..., key_block] & (key_pos[None, :] <= pos[:, None])  # [B, Hkv, tc, Tk]
        mask = mask[:, :, None]  # broadcast over G
        logits = (qg[:, :, :, c0:c1] @ kt[:, :, None]) * scale  # [B, Hkv, G, tc, Tk]
        logits = logits.masked_fill(~mask, -math.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        out[:, :, :, c0:c1] = probs @ vf[:, :, None]
    return out.permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d).to(q.dtype)


def infllm_v2_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: SparseParams,
    k1: Tensor | None = None,
    k2: Tensor | None = None,
    backend: str = "reference",
) -> Tensor:
    """Full InfLLM-v2 pipeline; queries are the last ``Tq`` positions of the ``Tk`` keys.

    ``k1``/``k2`` are the compressed keys of all ``Tk`` keys (computed from ``k`` when omitted). ``backend``
    (``salaquant.kernels.backend.use_triton``): ``"reference"`` runs this module's code, ``"triton"`` the Triton
    kernels (``_kernel_attention``), ``"auto"`` the kernels on CUDA tensors and the reference elsewhere.
    """
    tq, tk = q.shape[1], k.shape[1]
    if tq > tk:
        raise ValueError(f"more queries ({tq}) than keys ({tk})")
    q_start = tk - tq
    if k1 is None:
        k1 = compress_keys(k, params.kernel_size, params.kernel_stride)
    if k2 is None:
        k2 = compress_keys(k, params.kernel_size2, params.kernel_stride2)
    if use_triton(backend, q, k1, k2):
        return _kernel_attention(q, k, v, k1, k2, q_start, params)
    scores = stage1_scores(q, k1, k2, q_start, params)
    blocks = block_scores(scores, q_start, tk, params)
    idx = select_blocks(blocks, q_start, params)
    return block_sparse_attention(q, k, v, idx, q_start, params)


def _kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, k1: Tensor, k2: Tensor, q_start: int, params: SparseParams
) -> Tensor:
    """The pipeline on the Triton kernels: stage-1 scores, then pooling and top-k in one kernel, ``SELECT_CHUNK``
    queries at a time into one index tensor, then stage 2 over all queries. With at least
    ``LOCAL_DENSE_MIN_QUERIES`` queries, and when every selection holds its forced blocks
    (``params.keeps_forced_blocks``), the forced blocks go to the sliding-window kernel and the rest per query."""
    from ..kernels import infllm

    tq, tk = q.shape[1], k.shape[1]
    p = params
    n_sel = min(p.total_topk, -(-tk // p.block_size))
    idx = torch.empty(q.shape[0], k.shape[2], tq, n_sel, dtype=torch.int32, device=q.device)
    for c0 in range(0, tq, infllm.SELECT_CHUNK):
        c1 = min(tq, c0 + infllm.SELECT_CHUNK)
        start = q_start + c0
        scores = infllm.stage1_scores(
            q[:, c0:c1], k1, k2, start, p.kernel_size, p.kernel_stride, p.kernel_size2, p.kernel_stride2
        )
        infllm.pool_select(
            scores, start, tk, p.block_size, p.kernel_stride, p.init_blocks, p.local_blocks, p.total_topk,
            out=idx[:, :, c0:c1],
        )  # fmt: skip
        del scores
    if p.keeps_forced_blocks and tq >= infllm.LOCAL_DENSE_MIN_QUERIES:
        rest = drop_forced_blocks(idx, q_start, p)
        return infllm.block_sparse_attention(
            q, k, v, rest, q_start, p.block_size, forced=(p.init_blocks, p.local_blocks)
        )
    return infllm.block_sparse_attention(q, k, v, idx, q_start, p.block_size)
