"""Ragged paged attention: Pallas kernel, blocked jnp (the CPU path) and jnp reference vs a dense
numpy oracle (STYLE P7).

Batches mix prefills, prefill chunks, one-token decodes and idle sequences; KV lengths end
mid-page; every slot not holding a real key (page tails, unused pages) is NaN; page tables are
shuffled and their unused entries point anywhere; padded query rows are NaN; sequences past
num_seqs carry garbage. The kernel runs interpreted on CPU; the compiled class needs a GPU.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from serving_engine.kernels import (
    BlockSizes,
    kernel_supports,
    paged_attention,
    ragged_paged_attention,
    ragged_paged_attention_blocked,
    ragged_paged_attention_reference,
    write_to_kv_cache,
)

jax.config.update("jax_default_matmul_precision", "highest")

MAX_SEQS, NUM_TOKENS, PAGE_SIZE, PAGES_PER_SEQ, HEAD_DIM = 4, 32, 4, 6, 16
NUM_PAGES = MAX_SEQS * PAGES_PER_SEQ + 4  # spare pages stay NaN
TOL = dict(atol=2e-5, rtol=2e-5)  # fp32 online softmax vs a float64 oracle


@dataclass(frozen=True)
class Config:  # the static arguments: each one is one compilation
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False


CONFIGS = [
    Config(4, 2),  # GQA, G = 2
    Config(4, 4, sliding_window=5),  # MHA
    Config(6, 2, soft_cap=3.0),  # G = 3: the kernel pads the head group to 4
    Config(4, 1, sliding_window=3, soft_cap=2.0, sinks=True),  # MQA, GPT-OSS-style sinks
]


@st.composite
def ragged_layouts(draw):
    """(num_seqs, q_lens, kv_lens, seed) with sum(q_lens) <= NUM_TOKENS."""
    num_seqs = draw(st.integers(1, MAX_SEQS))
    q_lens, kv_lens, used = [], [], 0
    for i in range(num_seqs):
        kv_len = draw(st.integers(1, PAGES_PER_SEQ * PAGE_SIZE))
        kind = draw(st.sampled_from(["decode", "prefill", "chunk", "idle"]))
        q_len = {"decode": 1, "prefill": kv_len, "idle": 0}.get(kind)
        q_len = draw(st.integers(1, kv_len)) if kind == "chunk" else q_len
        q_len = min(q_len, NUM_TOKENS - used - (num_seqs - 1 - i))  # leave >= 1 token per seq
        q_lens.append(q_len)
        kv_lens.append(kv_len)
        used += q_len
    return num_seqs, q_lens, kv_lens, draw(st.integers(0, 2**31 - 1))


def build_case(layout, cfg: Config):
    num_seqs, q_lens, kv_lens, seed = layout
    rng = np.random.default_rng(seed)
    n, k, h, s = cfg.num_heads, cfg.num_kv_heads, HEAD_DIM, PAGE_SIZE
    # Garbage for the ignored sequences, out-of-range page ids included.
    page_indices = rng.integers(-3, NUM_PAGES + 3, (MAX_SEQS, PAGES_PER_SEQ)).astype(np.int32)
    kv = rng.integers(-5, 100, MAX_SEQS).astype(np.int32)
    cu = np.sort(rng.integers(0, NUM_TOKENS + 5, MAX_SEQS + 1)).astype(np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv[:num_seqs] = kv_lens

    k_pages = np.full((NUM_PAGES, s, k, h), np.nan, np.float32)
    v_pages = np.full((NUM_PAGES, s, k, h), np.nan, np.float32)
    free = list(rng.permutation(NUM_PAGES))  # shuffled, disjoint pages per live sequence
    for i, kv_len in enumerate(kv_lens):
        used = -(-kv_len // s)
        own = [free.pop() for _ in range(used)]
        page_indices[i] = rng.integers(0, NUM_PAGES, PAGES_PER_SEQ)  # unused entries: any page
        page_indices[i, :used] = own
        for pos in range(kv_len):
            k_pages[own[pos // s], pos % s] = rng.standard_normal((k, h))
            v_pages[own[pos // s], pos % s] = rng.standard_normal((k, h))

    q = np.full((NUM_TOKENS, n, h), np.nan, np.float32)  # padded tokens: NaN
    q[: cu[num_seqs]] = rng.standard_normal((cu[num_seqs], n, h))
    sinks = rng.standard_normal(n).astype(np.float32) if cfg.sinks else None
    return (q, k_pages, v_pages, kv, page_indices, cu, np.array([num_seqs], np.int32), sinks)


def dense_attention(q, k_pages, v_pages, kv_lens, page_indices, cu, num_seqs, sinks, *,
                    sm_scale, sliding_window, soft_cap):
    """Float64 numpy oracle: one sequence and one query token at a time over contiguous KV."""
    out = np.zeros(q.shape, np.float64)
    n, k = q.shape[1], k_pages.shape[2]
    for i in range(int(num_seqs[0])):
        kv_len, start, q_len = kv_lens[i], cu[i], cu[i + 1] - cu[i]
        pages = page_indices[i, : -(-kv_len // PAGE_SIZE)]
        keys = k_pages[pages].reshape(-1, k, HEAD_DIM)[:kv_len].astype(np.float64)
        vals = v_pages[pages].reshape(-1, k, HEAD_DIM)[:kv_len].astype(np.float64)
        for j in range(q_len):
            pos = kv_len - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(n):
                kv_head = head // (n // k)
                query = q[start + j, head].astype(np.float64)
                scores = keys[lo : pos + 1, kv_head] @ query * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                logits = scores if sinks is None else np.append(scores, sinks[head])
                weights = np.exp(logits - logits.max())
                weights = weights[: len(scores)] / weights.sum()
                out[start + j, head] = weights @ vals[lo : pos + 1, kv_head]
    return out


class _RaggedPagedAttentionCases:
    INTERPRET: bool
    BLOCK_SIZES: BlockSizes

    def kernel(self, args, cfg, block_sizes=None):
        block_sizes = block_sizes or self.BLOCK_SIZES
        assert self.INTERPRET or kernel_supports(args[0].shape, args[1].shape, block_sizes)
        return ragged_paged_attention(
            *args, sm_scale=HEAD_DIM**-0.5, sliding_window=cfg.sliding_window,
            soft_cap=cfg.soft_cap, interpret=self.INTERPRET, block_sizes=block_sizes)

    @pytest.mark.parametrize("cfg", CONFIGS, ids=str)
    @settings(max_examples=10, deadline=None, derandomize=True, database=None)
    @given(layout=ragged_layouts())
    # Decode mid-page, a prefill ending mid-page, an idle sequence, a chunk over the whole table.
    @example(layout=(4, [1, 9, 0, 13], [17, 9, 5, 24], 11))
    @example(layout=(3, [1, 1, 1], [24, 5, 1], 7))  # decode-only batch
    def test_matches_reference_and_dense(self, cfg, layout):
        args = build_case(layout, cfg)
        opts = dict(sm_scale=HEAD_DIM**-0.5, sliding_window=cfg.sliding_window,
                    soft_cap=cfg.soft_cap)
        out = np.asarray(self.kernel(args, cfg))
        ref = np.asarray(ragged_paged_attention_reference(*args, **opts))
        dense = dense_attention(*args, **opts)
        live = int(args[5][int(args[6][0])])  # cu_q_lens[num_seqs]
        assert np.isfinite(out).all() and np.isfinite(ref).all()
        np.testing.assert_array_equal(out[live:], 0.0)  # padded tokens
        np.testing.assert_array_equal(ref[live:], 0.0)
        np.testing.assert_allclose(ref, dense, **TOL)
        np.testing.assert_allclose(out, dense, **TOL)

    @settings(max_examples=4, deadline=None, derandomize=True, database=None)
    @given(layout=ragged_layouts())
    def test_default_block_sizes(self, layout):
        # One tile spans the whole page table (block_kv > pages_per_seq * S): the padded table path.
        cfg = CONFIGS[0]
        args = build_case(layout, cfg)
        dense = dense_attention(*args, sm_scale=HEAD_DIM**-0.5, sliding_window=None, soft_cap=None)
        np.testing.assert_allclose(np.asarray(self.kernel(args, cfg, BlockSizes())), dense, **TOL)

    def test_no_live_sequences(self):
        args = list(build_case((1, [3], [5], 0), CONFIGS[0]))
        args[6] = np.array(0, np.int32)  # scalar num_seqs is accepted too
        np.testing.assert_array_equal(np.asarray(self.kernel(args, CONFIGS[0])), 0.0)


class TestRaggedPagedAttentionInterpret(_RaggedPagedAttentionCases):
    INTERPRET = True
    BLOCK_SIZES = BlockSizes(block_q=4, block_kv=8)  # small tiles: many blocks and steps per seq


class TestRaggedPagedAttentionBlocked:
    """The CPU path: the kernel's schedule in dense jnp, each query block gathering its sequence's
    pages once. max_q_len is the static bound the model runner passes (1 in a pure decode step)."""

    @pytest.mark.parametrize("cfg", CONFIGS, ids=str)
    @settings(max_examples=6, deadline=None, derandomize=True, database=None)
    @given(layout=ragged_layouts())
    @example(layout=(4, [1, 9, 0, 13], [17, 9, 5, 24], 11))
    @example(layout=(3, [1, 1, 1], [24, 5, 1], 7))  # decode-only batch: max_q_len 1
    def test_matches_dense(self, cfg, layout):
        args = build_case(layout, cfg)
        opts = dict(sm_scale=HEAD_DIM**-0.5, sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap)
        dense = dense_attention(*args, **opts)
        live = int(args[5][int(args[6][0])])
        bound = max(layout[1])
        # small blocks (several per sequence) under the exact bound; the defaults with no bound (one block size)
        for kw in (dict(block_q=4, max_q_len=bound), {}):
            out = np.asarray(ragged_paged_attention_blocked(*args, **opts, **kw))
            assert np.isfinite(out).all(), kw
            np.testing.assert_array_equal(out[live:], 0.0)
            np.testing.assert_allclose(out, dense, **TOL, err_msg=str(kw))

    def test_bound_sizes_the_blocks(self):
        from serving_engine.kernels.blocked_attention import num_query_blocks
        assert num_query_blocks(16, 8, 1, 1) == 8  # a decode step padded to 16 tokens: one block per seq
        assert num_query_blocks(16, 8, 4, 16) == 12  # cdiv(T, block_q) + one partial block per seq
        assert num_query_blocks(2048, 8, 64, 256) == 32
        assert num_query_blocks(2048, 8, 64, 2048) == 40


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="the compiled kernel needs a GPU backend")
class TestRaggedPagedAttentionCompiled(_RaggedPagedAttentionCases):
    INTERPRET = False
    BLOCK_SIZES = BlockSizes(block_q=16, block_kv=16)  # Triton: tiles >= 16 and powers of two

    def test_auto_picks_kernel(self):
        args = build_case((2, [5, 1], [9, 13], 1), CONFIGS[0])
        assert kernel_supports(args[0].shape, args[1].shape, self.BLOCK_SIZES)
        auto = paged_attention(*args, sm_scale=0.25, block_sizes=self.BLOCK_SIZES)
        kernel = ragged_paged_attention(*args, sm_scale=0.25, block_sizes=self.BLOCK_SIZES)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(kernel))


def test_lowers_to_triton_without_a_gpu():
    # The GPU lowering builds Triton IR in Python (compute capability 9.0 when no GPU is
    # present), so unsupported primitives or shapes in the kernel body show up on CPU.
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    f32, i32, sd = jnp.float32, jnp.int32, jax.ShapeDtypeStruct
    t, n, h, p, s, k, m, pps = 64, 8, 64, 128, 16, 2, 8, 16
    args = (sd((t, n, h), f32), sd((p, s, k, h), f32), sd((p, s, k, h), f32), sd((m,), i32),
            sd((m, pps), i32), sd((m + 1,), i32), sd((1,), i32), sd((n,), f32))
    assert kernel_supports((t, n, h), (p, s, k, h))
    lowered = ragged_paged_attention.trace(
        *args, sm_scale=0.125, sliding_window=32, soft_cap=30.0).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_kernel_supports():
    assert kernel_supports((32, 8, 128), (64, 16, 8, 128))
    assert kernel_supports((32, 28, 128), (64, 16, 4, 128))  # G = 7 is padded to 8
    assert not kernel_supports((32, 4, 8), (64, 16, 2, 8))  # head_dim 8 < 16
    assert not kernel_supports((32, 4, 48), (64, 16, 2, 48))  # head_dim not a power of two
    assert not kernel_supports((32, 4, 16), (64, 12, 2, 16))  # page size not a power of two


def test_paged_attention_dispatch():
    args = build_case((3, [4, 1, 7], [4, 10, 20], 3), CONFIGS[1])
    opts = dict(sm_scale=0.25, sliding_window=5)
    ref = np.asarray(ragged_paged_attention_reference(*args, **opts))
    if jax.default_backend() != "gpu":  # auto = the blocked path
        blocked = np.asarray(ragged_paged_attention_blocked(*args, **opts))
        np.testing.assert_array_equal(np.asarray(paged_attention(*args, **opts)), blocked)
        np.testing.assert_allclose(blocked, ref, **TOL)
    np.testing.assert_array_equal(np.asarray(paged_attention(*args, **opts, impl="reference")), ref)
    small = BlockSizes(block_q=4, block_kv=8)
    interp = paged_attention(*args, **opts, impl="interpret", block_sizes=small)
    np.testing.assert_allclose(np.asarray(interp), ref, **TOL)
    with pytest.raises(ValueError):
        paged_attention(*args, **opts, impl="triton")


# ----------------------------------------------------------------------------------------------
# write_to_kv_cache
# ----------------------------------------------------------------------------------------------
def _write_case(seed=0, p=6, s=4, k=2, h=3, t=9):
    rng = np.random.default_rng(seed)
    k_pages = rng.standard_normal((p, s, k, h)).astype(np.float32)
    v_pages = rng.standard_normal((p, s, k, h)).astype(np.float32)
    slots = rng.permutation(p * s - 1)[:t].astype(np.int32)  # never the last slot
    slots[[2, 5, t - 1]] = -1  # padded tokens
    k_new = rng.standard_normal((t, k, h)).astype(np.float32)
    v_new = rng.standard_normal((t, k, h)).astype(np.float32)
    return k_pages, v_pages, k_new, v_new, slots


def _write_numpy(pages, new, slots):
    out = pages.copy()
    for i, slot in enumerate(slots):
        if slot >= 0:
            out[slot // pages.shape[1], slot % pages.shape[1]] = new[i]
    return out


@pytest.mark.parametrize("jit", [False, True])
def test_write_to_kv_cache(jit):
    k_pages, v_pages, k_new, v_new, slots = _write_case()
    fn = jax.jit(write_to_kv_cache, donate_argnums=(0, 1)) if jit else write_to_kv_cache
    k_out, v_out = fn(jnp.asarray(k_pages), jnp.asarray(v_pages), k_new, v_new, slots)
    np.testing.assert_array_equal(np.asarray(k_out), _write_numpy(k_pages, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _write_numpy(v_pages, v_new, slots))
    # -1 must not wrap around to the last slot (NumPy-style negative indexing).
    np.testing.assert_array_equal(np.asarray(k_out)[-1, -1], k_pages[-1, -1])


def test_write_then_attend():
    # The slot convention (page * S + offset) and the block table agree: write a prefill of
    # 7 tokens through a shuffled table into a NaN cache, then attend over it.
    cfg, kv_len = CONFIGS[0], 7
    rng = np.random.default_rng(5)
    table = rng.permutation(NUM_PAGES)[:PAGES_PER_SEQ].astype(np.int32)
    pos = np.arange(NUM_TOKENS)
    page = table[np.minimum(pos // PAGE_SIZE, PAGES_PER_SEQ - 1)]
    slots = np.where(pos < kv_len, page * PAGE_SIZE + pos % PAGE_SIZE, -1).astype(np.int32)
    k_new = rng.standard_normal((NUM_TOKENS, cfg.num_kv_heads, HEAD_DIM)).astype(np.float32)
    v_new = rng.standard_normal((NUM_TOKENS, cfg.num_kv_heads, HEAD_DIM)).astype(np.float32)
    nan = jnp.full((NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, HEAD_DIM), jnp.nan)
    k_pages, v_pages = write_to_kv_cache(nan, nan, k_new, v_new, slots)
    args = build_case((1, [kv_len], [kv_len], 0), cfg)
    page_indices = np.zeros((MAX_SEQS, PAGES_PER_SEQ), np.int32)
    page_indices[0] = table
    args = (args[0], k_pages, v_pages, args[3], page_indices, *args[5:])
    out = ragged_paged_attention_reference(*args, sm_scale=0.25)
    dense = _dense_contiguous(args[0], k_new[:kv_len], v_new[:kv_len], cfg, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(out), dense, **TOL)


def _dense_contiguous(q, keys, vals, cfg, sm_scale):
    """Causal attention of the first len(keys) query tokens over contiguous K/V; other rows 0."""
    out = np.zeros(q.shape, np.float64)
    group = cfg.num_heads // cfg.num_kv_heads
    for j in range(len(keys)):
        for head in range(cfg.num_heads):
            scores = keys[: j + 1, head // group].astype(np.float64) @ q[j, head] * sm_scale
            w = np.exp(scores - scores.max())
            out[j, head] = (w / w.sum()) @ vals[: j + 1, head // group]
    return out
