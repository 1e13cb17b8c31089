"""Ragged paged attention: prefill chunks and decodes of many sequences in one call.

Semantics (vLLM's FlashAttention metadata, tpu-inference's `ref_ragged_paged_attention`):
the flat token axis holds the new tokens of every sequence back to back, sequence i owning
rows `cu_q_lens[i]:cu_q_lens[i+1]`. Its KV (already written to the paged cache) has
`kv_lens[i]` tokens, stored through `page_indices[i]`. Query j of sequence i sits at the absolute
position `kv_lens[i] - q_len_i + j` (bottom-right causal), so one rule covers prefill, decode,
chunked prefill and prefix-cache hits. Key k is visible to query q iff `k <= q` and, with a
sliding window W, `q - k < W` (HF masking_utils). Scores are `q.k * sm_scale`, optionally
soft-capped `cap * tanh(s / cap)` before masking; softmax in fp32, optionally with a per-head
attention sink (GPT-OSS: `exp(sink)` joins the denominator only).

Layout of this file (STYLE P6): the Pallas kernel body, the jitted wrapper, the plain-jnp
reference. blocked_attention.py runs the kernel's schedule as dense jnp (the CPU path);
dispatch.py's `paged_attention` picks one of the three by backend.

Kernel plan (the schedule of vLLM's Triton unified attention, in Pallas): the wrapper cuts each
sequence's query tokens into blocks of `block_q` tokens, so there are at most
`cdiv(T, block_q) + max_seqs` blocks (a static bound), and gathers q into
`[blocks, K, block_q * G, H]`: all G query heads of one KV head are rows of one tile, so a
decode token still fills G rows. The grid is (blocks, K); each program walks its sequence's
pages `block_kv` keys at a time with an online softmax. Only portable `pl.*` operations are
used, so the same body runs with `interpret=True` on CPU and lowers to Triton on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "BlockSizes",
    "kernel_supports",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]

# Finite, so masked rows never compute (-inf) - (-inf) = NaN (tpu-inference and jax's GPU kernel
# use a large negative finite value for the same reason).
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Triton's fp32 dot defaults to TF32; HIGHEST lowers to IEEE fp32, which fp32 parity needs.
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (static). The compiled (Triton) kernel needs powers of two:
    `block_q * next_pow2(G)` query rows and `block_kv` (or the page size, if larger) keys."""

    block_q: int = 16  # query tokens of one sequence per program
    block_kv: int = 64  # keys per inner-loop step; rounded to whole pages
    num_warps: int = 4
    num_stages: int = 2

    def pages_per_block(self, page_size: int) -> int:
        return max(1, self.block_kv // page_size)


# ----------------------------------------------------------------------------------------------
# (a) Kernel body: one program = one query block of one sequence x one KV head.
# ----------------------------------------------------------------------------------------------
def _rpa_kernel(
    meta_ref,  # i32[4]: (seq, position of the block's first query, number of real queries, kv_len)
    table_ref,  # i32[max_seqs * pages_per_seq_padded]: flat page table
    sinks_ref,  # f32[R]: sink logit per row (mask value when there are no sinks)
    q_ref,  # f32[R, H]: R = block_q * Gp rows, row r = token r // Gp, query head r % Gp
    k_ref,  # f32[P, S, H]: this program's KV head of the whole cache
    v_ref,  # f32[P, S, H]
    o_ref,  # f32[R, H]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    group: int,  # Gp: padded query heads per KV head
    pages_per_seq: int,  # padded to a multiple of pages_per_block
    pages_per_block: int,
):
    seq, q_pos0, num_q, kv_len = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_kv = pages_per_block * page_size

    q = q_ref[...]
    row_tok = lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    q_pos = q_pos0 + row_tok  # i32[R]
    row_live = row_tok < num_q  # rows past the block's last real token are padding

    # Keys this block can see: [lo, hi). An empty block (num_q == 0) gets an empty range.
    hi = jnp.where(num_q > 0, jnp.minimum(q_pos0 + num_q, kv_len), 0)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(q_pos0 - sliding_window + 1, 0)
    first_step, last_step = lo // block_kv, pl.cdiv(hi, block_kv)

    def step(i, carry):
        acc, m, l = carry  # f32[R,H], f32[R], f32[R]
        pages = table_ref[pl.ds(seq * pages_per_seq + i * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_kv, head_dim)  # f32[block_kv, H]
        v = v_ref[pages].reshape(block_kv, head_dim)
        k_pos = i * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)  # i32[block_kv]
        # Slots at or past kv_len may hold anything (NaN included) and 0 * NaN = NaN in p @ v.
        v = jnp.where((k_pos < kv_len)[:, None], v, 0.0)

        s = jnp.dot(q, k.T, precision=_HIGHEST) * sm_scale  # f32[R, block_kv]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & row_live[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        s = jnp.where(visible, s, mask_value)

        m_next = jnp.maximum(m, s.max(axis=-1))
        # where(), not only the mask value: a row with nothing visible yet has m = mask value, and
        # exp(mask - mask) = 1 would weigh its masked keys (rescaled away later, but not for
        # padding rows). This keeps masked keys at exactly zero weight.
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m - m_next)
        acc = alpha[:, None] * acc + jnp.dot(p, v, precision=_HIGHEST)
        return acc, m_next, alpha * l + p.sum(axis=-1)

    # A sink enters the softmax as one extra logit with no value: start the running max there
    # with weight exp(sink - sink) = 1. Without sinks the sink is the mask value with weight 0.
    sink = sinks_ref[...]
    l0 = jnp.where(sink > mask_value, 1.0, 0.0).astype(jnp.float32)
    acc0 = jnp.zeros((rows, head_dim), jnp.float32)
    acc, _, l = lax.fori_loop(first_step, last_step, step, (acc0, sink, l0))
    o_ref[...] = (acc / jnp.where(l > 0.0, l, 1.0)[:, None]).astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# (b) Jitted wrapper.
# ----------------------------------------------------------------------------------------------
def _live_cu(cu_q_lens, num_seqs):
    """cu_q_lens with entries past num_seqs replaced by int32 max, so it stays sorted."""
    idx = jnp.arange(cu_q_lens.shape[0])
    return jnp.where(idx <= num_seqs, cu_q_lens, jnp.iinfo(jnp.int32).max)


def _token_seq(cu_q_lens, num_seqs, num_tokens):
    """Per flat token: its sequence, its index inside that sequence's queries, and liveness."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    live = (t >= cu_q_lens[0]) & (t < cu_q_lens[num_seqs])
    seq = jnp.searchsorted(_live_cu(cu_q_lens, num_seqs), t, side="right") - 1
    seq = jnp.clip(seq, 0, cu_q_lens.shape[0] - 2)
    return seq, t - cu_q_lens[seq], live


def _schedule(kv_lens, cu_q_lens, num_seqs, num_blocks, block_q):
    """Query blocks: meta i32[num_blocks, 4] rows (seq, first query position, real queries,
    kv_len), the first flat token of each block i32[num_blocks], and the first block of each
    sequence i32[max_seqs + 1]."""
    max_seqs = kv_lens.shape[0]
    seqs = jnp.arange(max_seqs)
    q_lens = jnp.where(seqs < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # i32[max_seqs]
    cu_blocks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pl.cdiv(q_lens, block_q))])
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # side="right" skips empty sequences, whose block range [cu, cu) is empty.
    seq = jnp.clip(jnp.searchsorted(cu_blocks, b, side="right") - 1, 0, max_seqs - 1)
    first = (b - cu_blocks[seq]) * block_q  # index of the block's first query within its seq
    num_q = jnp.where(b < cu_blocks[-1], jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    q_pos0 = kv_lens[seq] - q_lens[seq] + first
    meta = jnp.stack([seq, q_pos0, num_q, kv_lens[seq]], axis=1).astype(jnp.int32)
    return meta, cu_q_lens[seq] + first, cu_blocks.astype(jnp.int32)


def kernel_supports(q_shape, k_pages_shape, block_sizes: BlockSizes = BlockSizes()) -> bool:
    """Whether the compiled (Triton) kernel handles these shapes: its tiles must be powers of
    two and its dots at least 16 wide. Interpret mode has no such limits."""
    _, n, h = q_shape
    _, page_size, k, _ = k_pages_shape
    rows = block_sizes.block_q * pl.next_power_of_2(n // k)
    keys = block_sizes.pages_per_block(page_size) * page_size
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return all(pow2(x) and x >= 16 for x in (rows, keys, h)) and pow2(page_size)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "mask_value", "interpret",
                     "block_sizes"),
)
def ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    mask_value: float = DEFAULT_MASK_VALUE, interpret: bool = False,
    block_sizes: BlockSizes = BlockSizes(),
):
    """Ragged paged attention (Pallas kernel).

    Args:
      q: f32[T, N, H] new tokens of all sequences, flat, padded to the bucket size T.
      k_pages, v_pages: f32[P, S, K, H] paged cache (P pages of S slots), already holding the new
        tokens; query head n reads KV head n // (N // K).
      kv_lens: i32[max_seqs] KV length of each sequence, new tokens included.
      page_indices: i32[max_seqs, pages_per_seq] block table.
      cu_q_lens: i32[max_seqs + 1] query start offsets (vLLM's query_start_loc).
      num_seqs: i32[1] or i32[] live sequences; later sequences and tokens at or past
        cu_q_lens[num_seqs] are ignored and their output rows are 0.
      sinks: optional f32[N] attention-sink logit per query head.
      sm_scale, sliding_window, soft_cap, mask_value: static, see the module docstring.
      interpret: run the kernel body as plain JAX ops (CPU tests).
      block_sizes: static tile sizes.

    Returns:
      f32[T, N, H].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_heads // num_kv_heads
    gp = pl.next_power_of_2(group)  # pad the head group so tiles stay powers of two
    bq = block_sizes.block_q
    ppb = block_sizes.pages_per_block(page_size)
    num_blocks = min(pl.cdiv(num_tokens, bq) + max_seqs, num_tokens)  # each block has >= 1 token
    num_seqs = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), pages_per_seq * page_size)  # stay in the table

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    meta, first_tok, cu_blocks = _schedule(kv_lens, cu_q_lens, num_seqs, num_blocks, bq)

    # Gather q into tiles f32[blocks, K, bq * Gp, H]; padded rows are zero (never NaN).
    r = jnp.arange(bq)
    tok = jnp.where(r[None, :] < meta[:, 2:3], first_tok[:, None] + r[None, :], num_tokens)
    q_g = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_g = jnp.pad(q_g, ((0, 1), (0, 0), (0, gp - group), (0, 0)))  # row T = zeros
    q_tiles = q_g[tok].transpose(0, 2, 1, 3, 4)  # f32[blocks, K, bq, Gp, H]
    q_tiles = q_tiles.reshape(num_blocks, num_kv_heads, bq * gp, head_dim)

    if sinks is None:
        sink_rows = jnp.full((num_kv_heads, bq * gp), mask_value, jnp.float32)
    else:
        sink_heads = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
        sink_heads = jnp.pad(sink_heads, ((0, 0), (0, gp - group)), constant_values=mask_value)
        sink_rows = jnp.tile(sink_heads, (1, bq))  # f32[K, bq * Gp]: row r -> head r % Gp

    # Pad each table row to whole kernel steps; clamp stale entries so every load is in bounds.
    pps = pl.cdiv(pages_per_seq, ppb) * ppb
    table = jnp.pad(jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1),
                    ((0, 0), (0, pps - pages_per_seq))).reshape(-1)

    kernel = functools.partial(
        _rpa_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=mask_value, group=gp, pages_per_seq=pps, pages_per_block=ppb)
    rows = bq * gp
    out_tiles = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            pl.BlockSpec((pl.squeezed, 4), lambda b, h: (b, 0)),
            pl.BlockSpec((table.shape[0],), lambda b, h: (0,)),
            pl.BlockSpec((pl.squeezed, rows), lambda b, h: (h, 0)),
            pl.BlockSpec((pl.squeezed, pl.squeezed, rows, head_dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((num_pages, page_size, pl.squeezed, head_dim), lambda b, h: (0, 0, h, 0)),
            pl.BlockSpec((num_pages, page_size, pl.squeezed, head_dim), lambda b, h: (0, 0, h, 0)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, pl.squeezed, rows, head_dim),
                               lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(meta, table, sink_rows, q_tiles, k_pages, v_pages)

    # Scatter tiles back to flat tokens: token j of sequence i is row j % bq of block
    # cu_blocks[i] + j // bq.
    out = out_tiles.reshape(num_blocks, num_kv_heads, bq, gp, head_dim)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * bq, num_heads, head_dim)
    seq, j, live = _token_seq(cu_q_lens, num_seqs, num_tokens)
    row = jnp.where(live, (cu_blocks[seq] + j // bq) * bq + j % bq, 0)
    return jnp.where(live[:, None, None], out[row], 0.0).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# (c) Reference in plain jnp: gather every token's own sequence pages, mask, softmax.
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
):
    """Same contract as `ragged_paged_attention`, in plain jnp. Memory is
    O(T * pages_per_seq * S * K * H): fine for the CPU engine, not for long prefills."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)
    seq, j, live = _token_seq(cu_q_lens.astype(jnp.int32), num_seqs, num_tokens)

    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + j  # i32[T]
    pages = page_indices[seq]  # i32[T, pages_per_seq]
    k = k_pages[pages].reshape(num_tokens, -1, num_kv_heads, head_dim)  # f32[T, L, K, H]
    v = v_pages[pages].reshape(num_tokens, -1, num_kv_heads, head_dim)
    k_pos = jnp.arange(k.shape[1])  # i32[L]

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("tkgh,tlkh->tkgl", qg, k, precision=_HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    visible = (k_pos[None, :] <= q_pos[:, None]) & live[:, None]  # bool[T, L]
    if sliding_window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
    # Invisible keys contribute nothing, values included: slots past kv_len (and the pages of
    # ignored sequences) may hold NaN, and 0 * NaN = NaN.
    v = jnp.where(visible[:, :, None, None], v, 0.0)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.reshape(1, num_kv_heads, group, 1), (*s.shape[:3], 1))
        s = jnp.concatenate([s, sink.astype(s.dtype)], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # padded rows: all -inf -> p = 0
    denom = p.sum(axis=-1, keepdims=True)
    p = p[..., : k.shape[1]] / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("tkgl,tlkh->tkgh", p, v, precision=_HIGHEST)
    return o.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
