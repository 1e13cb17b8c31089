"""Steady-state decode throughput of the torch engine and the JAX engine on one workload.

    .venv/bin/python bench/bench_serving.py [--family llama3] [--requests 16] [--new-tokens 32] [--repeats 3]

Workload: N requests with prompts of 8-40 random token ids (numpy seed 0), M new tokens each, greedy,
ignore_eos (every request runs to M), ragged mode with max_num_seqs = N, so after one prefill step all
requests decode together. Each engine first runs the workload once as warm-up (the JAX engine compiles
there; reported separately), then `repeats` times timed. Decode tokens/s counts only steps in which every
scheduled request is a decode (one token each) and times them around engine.step().
Imports torch (bench/ is not a solution tree).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def workload(num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 400, int(rng.integers(8, 41))).tolist() for _ in range(num_requests)]


def run_once(engine, prompts, params) -> tuple[float, int, float, list[list[int]]]:
    """-> (decode seconds, decode tokens, total seconds, outputs) of one pass over the workload."""
    rids = [f"r{engine.num_steps}-{i}" for i in range(len(prompts))]  # fresh ids on every pass
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    decode_s, decode_tokens, outputs = 0.0, 0, {}
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) \
            and not engine.scheduler.waiting
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if decoding:
            decode_s += dt
            decode_tokens += len(outs)
        outputs.update((o.request_id, o.output_token_ids) for o in outs if o.finished)
    return decode_s, decode_tokens, time.perf_counter() - t_start, [outputs[r] for r in rids]


def bench(name, make_engine, prompts, params, repeats):
    t0 = time.perf_counter()
    engine = make_engine()
    load_s = time.perf_counter() - t0
    _, _, warm_s, warm_out = run_once(engine, prompts, params)
    runs = [run_once(engine, prompts, params) for _ in range(repeats)]
    assert all(r[3] == warm_out for r in runs), f"{name}: outputs changed between passes"
    tps = [tok / s for s, tok, _, _ in runs]
    return dict(name=name, load_s=load_s, warmup_s=warm_s, decode_tps=float(np.median(tps)),
                total_s=float(np.median([r[2] for r in runs])),
                compilations=engine.stats()["num_compilations"], outputs=warm_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="llama3")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", default="1,2",
                    help="torch intra-op thread counts to try; the fastest is compared (fair to torch: on a "
                         "busy 2-core host 2 OpenMP threads can be far slower than 1)")
    args = ap.parse_args()

    import torch

    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from serving_engine import config as jcfg
    from serving_engine.engine import LLMEngine as JaxEngine
    from torch_sources.serving import config as tcfg
    from torch_sources.serving.engine import LLMEngine as TorchEngine

    model_dir = f"assets/checkpoints/{args.family}"
    prompts = workload(args.requests)
    kw = dict(mode="ragged", block_size=16, num_blocks=256, max_num_seqs=args.requests,
              max_model_len=128, max_num_batched_tokens=1024)
    sp = dict(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    torch_runs = []
    for n in (int(x) for x in args.torch_threads.split(",")):
        torch.set_num_threads(n)
        torch_runs.append(bench(f"torch/{n}t", lambda: TorchEngine(model_dir, tcfg.EngineConfig(**kw)), prompts,
                                tcfg.SamplingParams(**sp), args.repeats))
    t = max(torch_runs, key=lambda r: r["decode_tps"])
    j = bench("jax", lambda: JaxEngine(model_dir, jcfg.EngineConfig(**kw)), prompts,
              jcfg.SamplingParams(**sp), args.repeats)

    print(f"{args.family}: {args.requests} requests, prompts 8-40 tokens, {args.new_tokens} new tokens, greedy, "
          f"ragged; JAX backend {jax.default_backend()}")
    print(f"{'engine':<8}{'load s':>9}{'warm-up s':>11}{'pass s':>9}{'decode tok/s':>15}{'compilations':>14}")
    for r in (*torch_runs, j):
        print(f"{r['name']:<8}{r['load_s']:>9.2f}{r['warmup_s']:>11.2f}{r['total_s']:>9.2f}"
              f"{r['decode_tps']:>15.0f}{r['compilations']:>14}")
    print(f"jax / fastest torch ({t['name']}) decode throughput: {j['decode_tps'] / t['decode_tps']:.2f}x; "
          f"greedy outputs identical: {t['outputs'] == j['outputs']}")


if __name__ == "__main__":
    main()
