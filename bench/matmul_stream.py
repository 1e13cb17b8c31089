"""The decode step's weight streaming, alone: does XLA:CPU read a model's matmul weights as fast as this machine
reads memory, and as numpy (its BLAS) and torch do? (issue 37: the minimal reproducer behind "decode near the read
roof").

    python bench/matmul_stream.py [--rows 16] [--layers 12] [--iters 10]

The matrices are the small llama3's (hidden 768, MLP 2048, GQA 12/4 heads of 64, vocabulary 32000: ~400 MB of fp32
weights, as bench_scale.py's serve workload reads each decode step), stored [in, out] as the JAX oracle holds them.
One pass = every layer's q, k, v, o, gate, up, down products and the head on R rows, each layer's input the
previous layer's output (a chain, as a decode step is). Each framework runs the same pass: JAX jitted (precision
highest), numpy (its BLAS), torch (`torch.matmul` at 1 and 2 threads); the figure is the weights' bytes over the
best time, beside the machine's read bandwidth (the sum of a 512 MiB array, each framework's own reduction).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

HIDDEN, MLP, Q, KV, VOCAB = 768, 2048, 768, 256, 32000


def weights(layers: int, rng) -> list[dict[str, np.ndarray]]:
    def w(i, o):
        return (rng.standard_normal((i, o), dtype=np.float32) * i ** -0.5).astype(np.float32)
    return [{"q": w(HIDDEN, Q), "k": w(HIDDEN, KV), "v": w(HIDDEN, KV), "o": w(Q, HIDDEN),
             "gate": w(HIDDEN, MLP), "up": w(HIDDEN, MLP), "down": w(MLP, HIDDEN)} for _ in range(layers)]


def chain(mm, x, layers, head):
    """The pass in any framework (`mm` its matmul): k and v are folded into the attention stand-in (each of q's
    three 256-wide groups plus k + v, as GQA shares a KV head), so no product is dead code."""
    rows = x.shape[0]
    for p in layers:
        q, k, v = mm(x, p["q"]), mm(x, p["k"]), mm(x, p["v"])
        a = (q.reshape(rows, Q // KV, KV) + (k + v).reshape(rows, 1, KV)).reshape(rows, Q)
        x = x + mm(a, p["o"])
        x = x + mm(mm(x, p["gate"]) * mm(x, p["up"]), p["down"]) * 1e-2
        x = x / (abs(x).max() + 1.0)  # bounded: an overflow's inf and NaN would time other code paths
    return mm(x, head)


def best(f, iters: int) -> float:
    f()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    layers, head = weights(args.layers, rng), rng.standard_normal((HIDDEN, VOCAB), dtype=np.float32) * 0.03
    x = rng.standard_normal((args.rows, HIDDEN), dtype=np.float32)
    nbytes = sum(a.nbytes for p in layers for a in p.values()) + head.nbytes
    big = np.ones(1 << 27, np.float32)  # 512 MiB
    print(f"{args.layers} layers + head: {nbytes / 1e6:.0f} MB of fp32 weights, {args.rows} rows")
    rows = []

    t = best(lambda: chain(np.matmul, x, layers, head), args.iters)
    rows.append(("numpy", t, best(lambda: big.sum(), args.iters)))

    import torch
    for threads in (1, 2):
        torch.set_num_threads(threads)
        tl = [{k: torch.from_numpy(v) for k, v in p.items()} for p in layers]
        th, tx, tbig = torch.from_numpy(head), torch.from_numpy(x), torch.from_numpy(big)
        with torch.no_grad():
            t = best(lambda: chain(torch.matmul, tx, tl, th), args.iters)
            rows.append((f"torch {threads}t", t, best(lambda: tbig.sum(), args.iters)))

    import jax
    import jax.numpy as jnp
    jax.config.update("jax_default_matmul_precision", "highest")
    jl = jax.device_put(layers)
    jh, jxx, jbig = jax.device_put(head), jax.device_put(x), jax.device_put(big)
    f = jax.jit(lambda x, ls, h: chain(jnp.matmul, x, ls, h))
    s = jax.jit(jnp.sum)
    t = best(lambda: f(jxx, jl, jh).block_until_ready(), args.iters)
    rows.append(("jax (XLA:CPU)", t, best(lambda: s(jbig).block_until_ready(), args.iters)))

    machine = max(big.nbytes / tr / 1e9 for _, _, tr in rows)  # the fastest reduction: what the machine reads
    print(f"{'framework':<16}{'pass ms':>10}{'weights GB/s':>15}{'its sum GB/s':>14}{'of machine':>12}")
    for name, t, tr in rows:
        gbs = nbytes / t / 1e9
        print(f"{name:<16}{t * 1e3:>10.1f}{gbs:>15.1f}{big.nbytes / tr / 1e9:>14.1f}{100 * gbs / machine:>11.0f}%")
    print(f"the machine reads {machine:.1f} GB/s (the fastest sum of a 512 MiB array above)")


if __name__ == "__main__":
    main()
