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

A pure decode step (max_q_len 1) takes its own path, `_decode_attention`: one query per sequence, so no
schedule, and the scores are a multiply-and-sum over head_dim in the gathered pages' own layout
[B, L, K, H]: a dot there makes XLA:CPU transpose every gathered K page first (the pages are ~all of a
decode step's attention bytes; at 16 sequences of 512 slots that copy was ~40% of the step's attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from serving_engine.kernels.ragged_paged_attention import _schedule, _token_seq

__all__ = ["ragged_paged_attention_blocked", "num_query_blocks", "choose_block_q"]

_HIGHEST = lax.Precision.HIGHEST


def num_query_blocks(num_tokens: int, max_seqs: int, block_q: int, max_q_len: int) -> int:
    """Static bound on the query blocks of a step: each block holds >= 1 token, a sequence of q
    tokens has cdiv(q, block_q) blocks, and no sequence has more than max_q_len tokens."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    return max(1, min(cdiv(num_tokens, block_q) + max_seqs, num_tokens, max_seqs * cdiv(max_q_len, block_q)))


# A block's gather of its sequence's pages costs about as much as this many query rows of scores.
_GATHER_ROWS = 64


def choose_block_q(num_tokens: int, max_seqs: int, max_q_len: int) -> int:
    """The query block (a power of two, 16 to 256, at most max_q_len) with the least work: every block holds
    `bq` query rows of scores and gathers its sequence's pages once. Few long sequences take one block each
    (8 prompts of <= 256 tokens: 256, a gather per prompt); many take small blocks, so that a sequence's last,
    partial block wastes few rows."""
    sizes = [b for b in (16, 32, 64, 128, 256) if b <= max(max_q_len, 16)]
    return min(sizes, key=lambda b: (num_query_blocks(num_tokens, max_seqs, b, max_q_len) * (b + _GATHER_ROWS), b))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len", "block_q"))
def ragged_paged_attention_blocked(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    max_q_len: int | None = None, block_q: int | None = None,
):
    """q f32[T,N,H] -> f32[T,N,H], as `ragged_paged_attention`. max_q_len: a bound on every live
    sequence's new tokens (the caller's; None = T). A sequence with more tokens than the bound
    would lose the tail of its queries, so the model runner passes the bound it measured. block_q: the query
    block (None: `choose_block_q`)."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_heads // num_kv_heads
    max_q_len = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    if max_q_len == 1:
        return _decode_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
                                 sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    bq = max(1, min(block_q or choose_block_q(num_tokens, max_seqs, max_q_len), max_q_len))
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

    # Both products as [B, K] batches of row-major matrices, each operand moved there once (the thin q, k, v and
    # o tiles): left to lay out the einsums itself, XLA:CPU transposed the scores and probabilities (~30% slower).
    q_m = q_rows.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * bq, head_dim)
    s = jnp.einsum("bkmh,bklh->bkml", q_m, k.transpose(0, 2, 1, 3), precision=_HIGHEST)
    s = s.reshape(num_blocks, num_kv_heads, group, bq, -1) * sm_scale  # f32[B,K,G,bq,L]
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
    o = jnp.einsum("bkml,bklh->bkmh", p.reshape(num_blocks, num_kv_heads, group * bq, -1), v.transpose(0, 2, 1, 3),
                   precision=_HIGHEST)
    o = o.reshape(num_blocks, num_kv_heads, group, bq, head_dim).transpose(0, 3, 1, 2, 4)  # f32[B, bq, K, G, H]

    # Token j of sequence i is row j % bq of block cu_blocks[i] + j // bq.
    out = o.reshape(num_blocks * bq, num_heads, head_dim)
    t_seq, j, live = _token_seq(cu_q_lens, num_seqs, num_tokens)
    row = jnp.where(live, (cu_blocks[t_seq] + j // bq) * bq + j % bq, 0)
    return jnp.where(live[:, None, None], out[row], 0.0).astype(q.dtype)


def _decode_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, *,
                      sm_scale: float, sliding_window: int | None, soft_cap: float | None):
    """Every live sequence has at most one new token: its query sits at position kv_len - 1 and sees keys
    [max(kv_len - W, 0), kv_len). Same contract as the blocked path (a sequence with no token this step gives
    no output row)."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_heads // num_kv_heads
    rows = min(num_tokens, max_seqs)  # a sequence past the token count has no token
    num_seqs = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    b = jnp.arange(rows, dtype=jnp.int32)
    has_query = (b < num_seqs) & (cu_q_lens[1:rows + 1] > cu_q_lens[:rows])
    kv_len = jnp.where(has_query, jnp.minimum(kv_lens[:rows].astype(jnp.int32), pages_per_seq * page_size), 0)
    q_rows = q[jnp.clip(cu_q_lens[:rows], 0, num_tokens - 1)].reshape(rows, 1, num_kv_heads, group, head_dim)

    pages = jnp.clip(page_indices[:rows], 0, num_pages - 1)
    k = k_pages[pages].reshape(rows, -1, num_kv_heads, head_dim)  # f32[B, L, K, H]
    v = v_pages[pages].reshape(rows, -1, num_kv_heads, head_dim)
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    lo = 0 if sliding_window is None else jnp.maximum(kv_len - sliding_window, 0)[:, None]
    seen = ((k_pos[None, :] >= lo) & (k_pos[None, :] < kv_len[:, None]))[:, :, None, None]  # bool[B, L, 1, 1]

    s = jnp.sum(q_rows * k[:, :, :, None, :], axis=-1) * sm_scale  # f32[B, L, K, G]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(seen, s, -jnp.inf)
    if sinks is not None:
        sink = sinks.astype(s.dtype).reshape(1, 1, num_kv_heads, group)
        s = jnp.concatenate([s, jnp.broadcast_to(sink, (rows, 1, num_kv_heads, group))], axis=1)
    m = jnp.max(s, axis=1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # a row with nothing visible: p = 0
    denom = p.sum(axis=1, keepdims=True)
    p = p[:, : k.shape[1]] / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("blkg,blkh->bkgh", p, jnp.where(seen, v, 0.0), precision=_HIGHEST)  # f32[B, K, G, H]

    t_seq, _, live = _token_seq(cu_q_lens, num_seqs, num_tokens)
    out = o.reshape(rows, num_heads, head_dim)[jnp.clip(t_seq, 0, rows - 1)]
    return jnp.where((live & (t_seq < rows))[:, None, None], out, 0.0).astype(q.dtype)
