"""Ragged paged attention on CPU: the Pallas kernel's schedule, as dense jnp.

Same contract as `ragged_paged_attention` (see its module). The plain reference gathers every query
token's whole page table: a 2048-token prefill over a 512-slot table moves 2048 x 512 keys per layer,
and a decode step padded to a 16-token bucket gathers 16 tables for 8 sequences. Here the queries are
cut into blocks of `block_q` tokens of one sequence (`_schedule`, shared with the kernel) and each
block gathers its sequence's pages once: f32[B, L, K, H] for B blocks, where B is bounded by the
static `max_q_len` as well (a pure decode step, max_q_len 1, has one block per sequence slot).

Every key a block's gather brings that no query of the block may see (past kv_len, before the
sliding window of the block's first query) has its value zeroed: such slots may hold anything,
NaN included, and 0 * NaN = NaN in p @ v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from serving_engine.kernels.ragged_paged_attention import _schedule, _token_seq

__all__ = ["ragged_paged_attention_blocked", "num_query_blocks"]

_HIGHEST = lax.Precision.HIGHEST


def num_query_blocks(num_tokens: int, max_seqs: int, block_q: int, max_q_len: int) -> int:
    """Static bound on the query blocks of a step: each block holds >= 1 token, a sequence of q
    tokens has cdiv(q, block_q) blocks, and no sequence has more than max_q_len tokens."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    return max(1, min(cdiv(num_tokens, block_q) + max_seqs, num_tokens, max_seqs * cdiv(max_q_len, block_q)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len", "block_q"))
def ragged_paged_attention_blocked(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    max_q_len: int | None = None, block_q: int = 64,
):
    """q f32[T,N,H] -> f32[T,N,H], as `ragged_paged_attention`. max_q_len: a bound on every live
    sequence's new tokens (the caller's; None = T). A sequence with more tokens than the bound
    would lose the tail of its queries, so the model runner passes the bound it measured."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_heads // num_kv_heads
    max_q_len = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    bq = max(1, min(block_q, max_q_len))
    num_blocks = num_query_blocks(num_tokens, max_seqs, bq, max_q_len)
    num_seqs = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), pages_per_seq * page_size)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    meta, first_tok, cu_blocks = _schedule(kv_lens, cu_q_lens, num_seqs, num_blocks, bq)
    seq, q_pos0, num_q, kv_len = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]

    # Queries of each block, f32[B, bq, K, G, H]; rows past the block's tokens read a zero row.
    r = jnp.arange(bq, dtype=jnp.int32)
    row_live = r[None, :] < num_q[:, None]  # bool[B, bq]
    tok = jnp.where(row_live, first_tok[:, None] + r[None, :], num_tokens)
    q_rows = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[tok].reshape(num_blocks, bq, num_kv_heads, group, head_dim)

    # Keys and values of each block's sequence, f32[B, L, K, H].
    pages = jnp.clip(page_indices[seq], 0, num_pages - 1)  # i32[B, pages_per_seq]
    k = k_pages[pages].reshape(num_blocks, -1, num_kv_heads, head_dim)
    v = v_pages[pages].reshape(num_blocks, -1, num_kv_heads, head_dim)
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)  # i32[L]
    q_pos = q_pos0[:, None] + r[None, :]  # i32[B, bq]
    lo = jnp.zeros_like(q_pos0) if sliding_window is None else jnp.maximum(q_pos0 - sliding_window + 1, 0)
    seen = (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] < kv_len[:, None])  # bool[B, L]
    v = jnp.where(seen[:, :, None, None], v, 0.0)

    s = jnp.einsum("bqkgh,blkh->bkgql", q_rows, k, precision=_HIGHEST) * sm_scale  # f32[B,K,G,bq,L]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & row_live[:, :, None] & seen[:, None, :]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    if sinks is not None:
        sink = sinks.astype(s.dtype).reshape(1, num_kv_heads, group, 1, 1)
        s = jnp.concatenate([s, jnp.broadcast_to(sink, (*s.shape[:4], 1))], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # rows with nothing visible: p = 0
    denom = p.sum(axis=-1, keepdims=True)
    p = p[..., : k.shape[1]] / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkgql,blkh->bqkgh", p, v, precision=_HIGHEST)  # f32[B, bq, K, G, H]

    # Token j of sequence i is row j % bq of block cu_blocks[i] + j // bq.
    out = o.reshape(num_blocks * bq, num_heads, head_dim)
    t_seq, j, live = _token_seq(cu_q_lens, num_seqs, num_tokens)
    row = jnp.where(live, (cu_blocks[t_seq] + j // bq) * bq + j % bq, 0)
    return jnp.where(live[:, None, None], out[row], 0.0).astype(q.dtype)
