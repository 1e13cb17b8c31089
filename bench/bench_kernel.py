"""Time the compiled ragged paged-attention kernel against the jnp reference on one ragged batch.

Meant for a GPU: `python bench/bench_kernel.py` (defaults: Llama-3-8B attention shapes, a
bucket of 1024 tokens holding 4 prefill chunks of 192 tokens and 60 decodes, contexts up to 2048).
`--interpret --small` is a seconds-long CPU smoke run of the script itself; its timings mean
nothing (interpret mode is orders of magnitude slower than the compiled kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_engine.kernels import (  # noqa: E402
    BlockSizes,
    kernel_supports,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


def make_batch(args, rng):
    """Prefill chunks (with a cached prefix) first, then one-token decodes, padded to a bucket."""
    s = args.page_size
    pages_per_seq = -(-args.context // s)
    q_lens = [args.chunk] * args.prefills + [1] * args.decodes
    kv_lens = [int(rng.integers(args.chunk, args.context + 1)) for _ in range(args.prefills)]
    kv_lens += [int(rng.integers(args.context // 2, args.context + 1)) for _ in range(args.decodes)]
    num_seqs = len(q_lens)
    max_seqs = max(args.max_seqs, num_seqs)
    num_tokens = max(args.num_tokens, sum(q_lens))

    num_pages = max_seqs * pages_per_seq
    table = rng.permutation(num_pages).astype(np.int32).reshape(max_seqs, pages_per_seq)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1 :] = cu[num_seqs]
    kv = np.zeros(max_seqs, np.int32)
    kv[:num_seqs] = kv_lens
    shape = (num_pages, s, args.kv_heads, args.head_dim)
    k_pages = rng.standard_normal(shape, dtype=np.float32)
    v_pages = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((num_tokens, args.heads, args.head_dim), dtype=np.float32)
    batch = (q, k_pages, v_pages, kv, table, cu, np.array([num_seqs], np.int32))
    return tuple(jax.device_put(x) for x in batch)


def bench(fn, iters):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-tokens", type=int, default=1024, help="token bucket T")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--chunk", type=int, default=192, help="query tokens per prefill chunk")
    p.add_argument("--decodes", type=int, default=60)
    p.add_argument("--context", type=int, default=2048, help="max KV length per sequence")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-q", type=int, default=16)
    p.add_argument("--block-kv", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="run the kernel interpreted (CPU)")
    p.add_argument("--small", action="store_true", help="tiny shapes for a smoke run")
    p.add_argument("--decode", action="store_true", help="a pure decode batch (no prefill chunks) and its achieved "
                   "K/V read bandwidth against the device's, measured by streaming a 1 GiB array")
    args = p.parse_args()
    if args.small:
        args.num_tokens, args.max_seqs, args.prefills, args.chunk, args.decodes = 64, 8, 2, 16, 4
        args.context, args.heads, args.kv_heads, args.head_dim, args.iters = 64, 4, 2, 16, 2
    if args.decode:
        args.prefills, args.num_tokens = 0, max(args.decodes, 8)

    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"backend={jax.default_backend()} devices={jax.devices()}")
    blocks = BlockSizes(args.block_q, args.block_kv, args.num_warps, args.num_stages)
    batch = make_batch(args, np.random.default_rng(0))
    q, k_pages = batch[0], batch[1]
    if not args.interpret and not kernel_supports(q.shape, k_pages.shape, blocks):
        sys.exit(f"the compiled kernel does not support these shapes/blocks: {blocks}")
    scale = args.head_dim**-0.5

    def kernel():
        return ragged_paged_attention(*batch, sm_scale=scale, interpret=args.interpret,
                                      block_sizes=blocks)

    def reference():
        return ragged_paged_attention_reference(*batch, sm_scale=scale)

    err = float(np.abs(np.asarray(kernel()) - np.asarray(reference())).max())
    t_kernel, t_ref = bench(kernel, args.iters), bench(reference, args.iters)
    print(f"T={q.shape[0]} seqs={int(batch[6][0])} q={args.prefills}x{args.chunk}+{args.decodes}x1 "
          f"context<={args.context} N={args.heads} K={args.kv_heads} H={args.head_dim} "
          f"S={args.page_size} {blocks}")
    print(f"kernel    {t_kernel * 1e3:9.3f} ms")
    print(f"reference {t_ref * 1e3:9.3f} ms")
    print(f"ratio reference/kernel {t_ref / t_kernel:.2f}x   max|kernel-reference| {err:.2e}")
    if args.decode:
        kv_bytes = int(np.asarray(batch[3]).sum()) * args.kv_heads * args.head_dim * 4 * 2  # K and V, fp32
        peak = device_bandwidth(args.iters)
        print(f"decode attention reads {kv_bytes / 2**20:.1f} MiB of K/V: {kv_bytes / t_kernel / 1e9:.1f} GB/s "
              f"achieved, {100 * kv_bytes / t_kernel / 1e9 / peak:.0f}% of the device's {peak:.0f} GB/s "
              f"(a 1 GiB array read and written)")


def device_bandwidth(iters: int) -> float:
    """GB/s the device streams: one read and one write of a 1 GiB fp32 array per call."""
    x = jax.device_put(np.ones(1 << 28, np.float32))
    f = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / bench(lambda: f(x), iters) / 1e9


if __name__ == "__main__":
    main()
