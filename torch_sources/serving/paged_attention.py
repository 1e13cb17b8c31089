"""Paged KV cache and ragged paged attention in plain PyTorch (eager fp32).

Semantics follow tpu-inference's `ref_ragged_paged_attention` and vLLM's FlashAttention backend:
- the cache of a layer is k, v f32[P,S,K,H] (P pages of S token slots); a slot is
  `page * S + offset`, and new K/V are written by slot mapping (slot -1 = padding, no write);
- one step is a ragged batch: sequence i owns query tokens cu_q_lens[i]:cu_q_lens[i+1] and, after the
  write, kv_lens[i] cached tokens reached through its row of page_indices;
- causal mask bottom-right aligned: query j of sequence i sits at position kv_len - q_len + j and sees keys
  0..that position; a sliding window W also needs q_pos - k_pos < W (W keys, itself included);
- optional soft cap on the scores (cap * tanh(s / cap)), fp32 softmax, GQA (query head n reads KV head
  n // (N / K));
- optional attention sinks (GPT-OSS): a learned logit per query head joins the softmax normaliser only,
  p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)), as transformers' eager GPT-OSS attention.

Gemma 4: full and sliding layers may differ in K and H, so every layer gets its own pair of tensors; a
KV-shared layer owns no cache (its entry is None) and reads the cache of `kv_source_layer(i)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PagedKVCache", "AttentionMetadata", "allocate_kv_cache", "layer_kv_shapes", "write_to_kv_cache",
           "ragged_paged_attention"]


@dataclass
class PagedKVCache:
    k: tuple  # per layer f32[P,S,K,H], None for a KV-shared layer (it reads its source layer's cache)
    v: tuple
    block_size: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors of one step (built by the model runner from input_batch.BatchMetadata)."""
    slot_mapping: torch.Tensor  # i32[T]: where each token's K/V goes, -1 for padding tokens
    kv_lens: torch.Tensor  # i32[max_seqs]: KV length after this step's write
    page_indices: torch.Tensor  # i32[max_seqs, pages_per_seq]: block table
    cu_q_lens: torch.Tensor  # i32[max_seqs+1]: query start offsets
    num_seqs: torch.Tensor  # i32[1]: real rows of the per-sequence tensors


def layer_kv_shapes(model_config) -> list[tuple[int, int] | None]:
    """(num_kv_heads, head_dim) of each layer's cache, None for a KV-shared layer (Gemma 4)."""
    c = model_config
    shapes = []
    for i in range(c.num_hidden_layers):
        if hasattr(c, "is_kv_shared") and c.is_kv_shared(i):
            shapes.append(None)
        elif hasattr(c, "layer_head_dim"):  # per-layer dims (Gemma 4's full layers differ)
            shapes.append((c.layer_num_kv_heads(i), c.layer_head_dim(i)))
        else:
            shapes.append((c.num_key_value_heads, c.head_dim))
    return shapes


def allocate_kv_cache(model_config, engine_config) -> PagedKVCache:
    """Zeroed cache of engine_config.num_blocks pages of engine_config.block_size slots for every layer."""
    P, S = engine_config.num_blocks, engine_config.block_size
    ks, vs = [], []
    for shape in layer_kv_shapes(model_config):
        ks.append(None if shape is None else torch.zeros(P, S, *shape))
        vs.append(None if shape is None else torch.zeros(P, S, *shape))
    return PagedKVCache(k=tuple(ks), v=tuple(vs), block_size=S)


def write_to_kv_cache(k_pages, v_pages, k_new, v_new, slot_mapping):
    """k_pages, v_pages f32[P,S,K,H]; k_new, v_new f32[T,K,H]; slot_mapping i32[T] (-1: skip).

    Writes in place (index_copy_ on a flat [P*S,K,H] view) and returns (k_pages, v_pages)."""
    P, S, K, H = k_pages.shape
    slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.int64)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_pages.view(P * S, K, H).index_copy_(0, slots, k_new[keep].to(k_pages.dtype))
    v_pages.view(P * S, K, H).index_copy_(0, slots, v_new[keep].to(v_pages.dtype))
    return k_pages, v_pages


def _attend_one(q, k, v, sm_scale, sliding_window, soft_cap, sinks):
    """One sequence: q f32[Tq,N,H], k, v f32[L,K,H] (L = kv_len, the queries are its last Tq), sinks f32[N] | None
    -> f32[Tq,N,H]."""
    Tq, N, H = q.shape
    L, K, _ = k.shape
    q_pos = torch.arange(L - Tq, L)[:, None]  # i64[Tq,1]
    k_pos = torch.arange(L)[None, :]  # i64[1,L]
    allowed = k_pos <= q_pos  # bool[Tq,L]
    if sliding_window is not None:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    qg = q.view(Tq, K, N // K, H)
    scores = torch.einsum("tkgh,skh->kgts", qg, k) * sm_scale  # f32[K,G,Tq,L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    if sinks is not None:  # one extra logit per head, dropped after the softmax
        sink = sinks.float().view(K, N // K, 1, 1).expand(K, N // K, Tq, 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("kgts,skh->tkgh", probs, v).reshape(Tq, N, H)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None, sinks=None):
    """q f32[T,N,H]; k_pages, v_pages f32[P,S,K,H] (this step's K/V already written); kv_lens i32[max_seqs];
    page_indices i32[max_seqs, pages_per_seq]; cu_q_lens i32[max_seqs+1]; num_seqs i32[1]; sinks f32[N] | None
    -> f32[T,N,H].

    Tokens past cu_q_lens[num_seqs] (bucket padding) get zeros."""
    S = k_pages.shape[1]
    K, H = k_pages.shape[2:]
    out = torch.zeros_like(q)
    n = int(torch.as_tensor(num_seqs).reshape(-1)[0])
    kv_lens, cu = torch.as_tensor(kv_lens).tolist(), torch.as_tensor(cu_q_lens).tolist()
    page_indices = torch.as_tensor(page_indices, dtype=torch.int64)
    for i in range(n):  # one sequence at a time: gather its pages in logical order, attend densely
        start, end, L = cu[i], cu[i + 1], kv_lens[i]
        if end == start:
            continue
        pages = page_indices[i, : -(-L // S)]
        k = k_pages[pages].reshape(-1, K, H)[:L]  # f32[L,K,H]
        v = v_pages[pages].reshape(-1, K, H)[:L]
        out[start:end] = _attend_one(q[start:end], k, v, sm_scale, sliding_window, soft_cap, sinks)
    return out
