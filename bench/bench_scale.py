"""torch source vs JAX oracle at one scale, side by side: `make bench SCALE=small`.

    python bench/bench_scale.py [--scale small] [--only sft,dpo,ppo,serve] [--torch-threads 1,2] [--steps 3]
    python bench/bench_scale.py --scale small --only curve [--curve-requests 1,4,16,64] [--torch-threads 2]
    python bench/bench_scale.py --scale small --only prefill

Every (workload, side) runs in its own process, so each side's peak resident memory is its own
(ru_maxrss: the checkpoint load included). Torch runs at each of --torch-threads and the fastest is
compared (the project pins torch to one thread, fastest at tiny scale, not at ~100M parameters); JAX
uses the whole machine, as it does by default. Workloads (llama3 of the scale, the checkpoint from
tools/checkpoints_small.py, written on first use):

- sft: one LoRA optimizer step (forward, backward, clip, AdamW) on one micro-batch of B x T random tokens,
  the first 64 of each row a masked prompt; steady state (best of --steps, after a warm-up step that
  holds the JAX compile);
- dpo: one DPO step on B/2 pairs (chosen and rejected rows of T tokens), policy and reference passes;
- ppo: one PPO step of the shipped prompts (rollout with generation, reward model, TRL's step);
- serve: the serving engines on a ragged workload: R requests of 32-256 random tokens arriving at once,
  G new tokens each, greedy: time to first token cold (the first pass of a fresh engine in a fresh process,
  compiles included) and warm (the same prompts again; median of --steps passes), median over requests, and
  decode tokens/s (steps in which every scheduled request decodes). Then the same with a warm-up at engine
  start (warm_up: dummy requests through the public API, one step per token bucket and per decode row
  bucket) and, on the JAX side, the persistent compilation cache in --jax-cache (a restart too when the
  cache was empty: the second start reads what the first wrote). --no-serve-warmup skips these.
Only when --only names them:
- curve: the throughput curve, N of --curve-requests requests (ragged prompts, all at once, greedy, G
  tokens each; a fresh engine per point with max_num_seqs N, one warm-up pass, one timed pass): decode
  tokens/s and median TTFT of both engines against the decode roof of N rows; a table, and
  reports/bench/curve-<scale>.png (.json beside it); exits 1 if greedy outputs differ at any point;
- prefill: where the serve workload's time to first token goes: per prefill step, the scheduler, the
  runner's host work and the model call (JAX: compile and run apart), cold and warm, and JAX's warm prefill
  under two other token-bucket grids (multiples of 128; one bucket of exactly the prompt tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
TOKENIZER, SFT_DATA = ROOT / "assets/tokenizer/llama3", ROOT / "assets/data/sft"
SHAPES = {"tiny": dict(rows=4, length=64, requests=16, new_tokens=32, prompt=(8, 41), model_len=128),
          "small": dict(rows=4, length=512, requests=8, new_tokens=64, prompt=(32, 257), model_len=512)}
WORKLOADS = ("sft", "dpo", "ppo", "serve")
EXTRA = ("curve", "prefill")  # run only when --only names them
PROBES = ("roof",)
PROMPT_MASK = 64


def checkpoint(scale: str, name: str = "llama3") -> Path:
    if scale == "tiny":
        return ROOT / "assets" / "checkpoints" / name
    from checkpoints_small import ensure_small
    return ensure_small(name, log=lambda m: print(m, file=sys.stderr, flush=True))


def _token_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    labels = ids.copy()
    labels[:, :min(PROMPT_MASK, length // 2)] = -100
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _timed(step, steps: int) -> list[float]:
    step()  # warm-up: the JAX compile, torch's first allocations
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


# ---- workers: one (workload, side) per process --------------------------------------------------

def sft_step(side: str, scale: str):
    model_dir, s = checkpoint(scale), SHAPES[scale]
    batch = _token_batch(s["rows"], s["length"], _vocab(model_dir))
    if side == "torch":
        from torch_sources.training import sft
        args = sft.TrainArgs(gradient_accumulation_steps=1)
        model = sft.load_model(model_dir, sft.lora_config(args), args.seed)
        model.train()
        optimizer, scheduler = sft.create_optimizer(model.named_parameters(), args, 10 ** 6)
        return lambda: sft._train_step(model, optimizer, scheduler, [batch], args.max_grad_norm)
    import jax
    from jax_oracles.training import sft
    from jax_oracles.training.lora import init_lora_tree
    args = sft.TrainArgs(gradient_accumulation_steps=1)
    model = sft.load_model(model_dir, sft.lora_config(args))
    tx = sft._lora_optimizer(args, 10 ** 6)
    state = {"lora": init_lora_tree(model.params, sft.lora_config(args), args.seed)}
    state["opt"] = tx.init(state["lora"])
    step_fn = sft._train_step_fn(model.module, tx)
    stacked = {k: v[None] for k, v in batch.items()}  # [GA=1, B, T]

    def step():
        state["lora"], state["opt"], loss = step_fn(model.params, state["lora"], state["opt"], stacked)
        jax.block_until_ready(loss)
    return step


def dpo_step(side: str, scale: str):
    model_dir, s = checkpoint(scale), SHAPES[scale]
    batch = _token_batch(s["rows"], s["length"], _vocab(model_dir))  # rows: B/2 chosen, then B/2 rejected
    if side == "torch":
        from torch_sources.training import dpo
        args = dpo.DPOArgs(gradient_accumulation_steps=1)
        model = dpo.load_model(model_dir, dpo.lora_config(args), args.seed)
        model.train()
        optimizer, scheduler = dpo.create_optimizer(model.named_parameters(), args, 10 ** 6)
        return lambda: dpo._train_step(model, optimizer, scheduler, [batch], args)
    import jax
    from jax_oracles.training import dpo
    from jax_oracles.training.lora import init_lora_tree
    args = dpo.DPOArgs(gradient_accumulation_steps=1)
    model = dpo.load_model(model_dir, dpo.lora_config(args))
    tx = dpo._lora_optimizer(args, 10 ** 6)
    state = {"lora": init_lora_tree(model.params, dpo.lora_config(args), args.seed)}
    state["opt"] = tx.init(state["lora"])
    step_fn = dpo._train_step_fn(model.module, args, tx)
    stacked = dpo._stack_step([batch], 1, s["rows"] // 2, s["length"], pad_token_id=0)  # + pair and micro masks

    def step():
        state["lora"], state["opt"], loss, _ = step_fn(model.params, state["lora"], state["opt"], stacked)
        jax.block_until_ready(loss)
    return step


def ppo_step(side: str, scale: str):
    model_dir, reward_dir = checkpoint(scale), checkpoint(scale, "llama3-reward")
    counter = iter(range(10 ** 6))
    if side == "torch":
        from torch_sources.training import ppo
        args = ppo.PPOArgs()
        prompts = ppo.load_prompt_dataset(TOKENIZER, SFT_DATA, "train", args)
        batch = [prompts[i] for i in ppo.prompt_batch_indices(len(prompts), args, 0)[0]]
        eos, pad = ppo.generation_ids(TOKENIZER, args)
        model, reward = ppo.load_policy(model_dir, args), ppo.load_reward_model(reward_dir)
        optimizer, scheduler = ppo.create_optimizer(model.named_parameters(), args, 10 ** 6)
        kl_ctl = ppo.AdaptiveKLController(args.init_kl_coef, args.ppo_target, args.horizon)

        def step():
            i = next(counter)
            q, r, sc = ppo.rollout(model, reward, batch, args, eos, pad, i)
            ppo.ppo_step(model, optimizer, scheduler, kl_ctl, q, r, sc, args, pad, i)
        return step
    import jax
    import jax.numpy as jnp
    from jax_oracles.training import ppo
    args = ppo.PPOArgs()
    prompts = ppo.load_prompt_dataset(TOKENIZER, SFT_DATA, "train", args)
    batch = [prompts[i] for i in ppo.prompt_batch_indices(len(prompts), args, 0)[0]]
    width = ppo._prompt_width(prompts)
    eos, pad = ppo.generation_ids(TOKENIZER, args)
    policy, trainable = ppo.load_policy(model_dir, args)
    reward, v_head = ppo.load_reward_model(reward_dir)
    state = {"trainable": trainable, "opt": ppo._adam(args).init(trainable),
             "kl": jnp.asarray(args.init_kl_coef, jnp.float32)}

    def step():
        i = next(counter)
        rollout, _ = ppo.rollout(policy, state["trainable"]["lora"], reward, v_head, batch, args, eos, pad, i, width)
        state["trainable"], state["opt"], state["kl"], stats = ppo.ppo_step(
            policy, state["trainable"], state["opt"], state["kl"], rollout, args, i, 10 ** 6)
        jax.block_until_ready(stats)
    return step


def _serve_prompts(model_dir: Path, scale: str, n: int) -> list[list[int]]:
    """n prompts of SHAPES[scale]["prompt"] random token ids (seed 0): the first k of any n are the same k."""
    rng = np.random.default_rng(0)
    vocab = min(_vocab(model_dir), 400)  # ids below the tokenizer's specials: no prompt hits an EOS
    return [rng.integers(0, vocab, int(rng.integers(*SHAPES[scale]["prompt"]))).tolist() for _ in range(n)]


def _engine_kw(scale: str, requests: int) -> dict:
    s = SHAPES[scale]
    return dict(mode="ragged", block_size=16, max_num_seqs=requests, max_model_len=s["model_len"],
                num_blocks=requests * s["model_len"] // 16 + 16, max_num_batched_tokens=4096)


def _engine(side: str, model_dir: Path, kw: dict, **runner_kwargs):
    """-> (engine, its config module); runner_kwargs (JAX only) go to the ModelRunner (token_buckets)."""
    if side == "torch":
        from torch_sources.serving import config as cfg
        from torch_sources.serving.engine import LLMEngine
    else:
        from serving_engine import config as cfg
        from serving_engine.engine import LLMEngine
    return LLMEngine(str(model_dir), cfg.EngineConfig(**kw), **runner_kwargs), cfg


def warm_up(engine, cfg, kw: dict, token_id: int = 7) -> dict:
    """Dummy requests through the public API before anything is timed, so that the JAX engine's compiles (and
    torch's first-call allocations) leave the timed path; the engine itself is not changed (serving_engine/ is
    the graded oracle, and its torch twin must keep the same public names).

    One step in each token bucket a step can fill (powers of two from 16 up to the step budget, a subset of the JAX
    runner's default grid, serving_engine.input_batch.make_token_buckets), each filled by whole prompts prefilled together
    (exactly, or as far as max_num_seqs prompts of max_model_len - 2 tokens reach); then, for each power-of-two row bucket up to max_num_seqs, that many requests decoding
    together (a pure decode step is its own compiled variant of its bucket). Greedy, 2 new tokens each, the
    same sampling flags as the workloads (another flag set, e.g. top-k, would compile its own variant). Every
    dummy request finishes, so its KV blocks go back to the pool and the scheduler is empty again (prefix
    caching off in these workloads: no block stays hashed); outputs of later requests are unchanged (the bench
    compares them with torch's). -> {"warmup_s", "warmup_steps"}."""
    budget, seqs, longest = kw["max_num_batched_tokens"], kw["max_num_seqs"], kw["max_model_len"] - 2
    buckets = [16]
    while buckets[-1] < budget:
        buckets.append(buckets[-1] * 2)
    groups = []
    for b in buckets:  # prefill: b tokens (or as many as max_num_seqs prompts hold) in whole prompts
        t = min(b, seqs * longest)
        if t > b // 2 or b == buckets[0]:  # else no step reaches this bucket
            k = -(-t // longest)
            groups.append([t // k + (i < t % k) for i in range(k)])
    rows = 1
    groups.append([4])  # decode: each row bucket, 1, 2, 4, 8 (the runner's row_buckets), 16, 32, ... up to max_num_seqs
    while rows < seqs:
        rows = min(rows * 2, seqs)
        groups.append([4] * rows)
    params = cfg.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0, steps = time.perf_counter(), engine.num_steps
    for g, lengths in enumerate(groups):
        for i, n in enumerate(lengths):
            engine.add_request(f"warmup-{g}-{i}", [token_id] * n, params)
        while engine.has_unfinished_requests():
            engine.step()
    return {"warmup_s": time.perf_counter() - t0, "warmup_steps": engine.num_steps - steps}


def _compile_clock() -> dict:
    """JAX's own compile events summed as they happen: seconds of tracing, lowering and XLA compilation (a
    persistent-cache hit counts its read), and cache hits."""
    from jax import monitoring
    clock = {"compile_s": 0.0, "cache_hits": 0}
    timed = {"/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration"}

    def on_duration(event, secs, **_):
        if event in timed:
            clock["compile_s"] += secs

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            clock["cache_hits"] += 1
    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    return clock


def _use_jax_cache(cache_dir: str) -> None:
    """The persistent compilation cache, chosen here (the engine sets none): every compile written, however short."""
    import jax
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _fresh_engine(side: str, scale: str, jax_cache: str):
    """The serve workload's prompts and a freshly built engine (its compile clock and build seconds)."""
    model_dir, s = checkpoint(scale), SHAPES[scale]
    prompts = _serve_prompts(model_dir, scale, s["requests"])
    kw = _engine_kw(scale, s["requests"])
    clock = _compile_clock() if side == "jax" else {}
    if side == "jax":
        _use_jax_cache(jax_cache)
    t0 = time.perf_counter()
    engine, cfg = _engine(side, model_dir, kw)
    return s, prompts, kw, clock, engine, cfg, time.perf_counter() - t0


def serve(side: str, scale: str, repeats: int, warmup: bool = False, jax_cache: str = "") -> dict:
    """One fresh engine: [warm-up], a cold pass (the engine's first requests: compiles in the path unless a warm-up
    or the persistent cache took them out), then `repeats` warm passes of the same prompts."""
    s, prompts, kw, clock, engine, cfg, build_s = _fresh_engine(side, scale, jax_cache)
    out = {"build_s": build_s, "warmup_s": None}
    if warmup:
        out.update(warm_up(engine, cfg, kw))
    out["warmup_compile_s"] = clock.get("compile_s")
    params = cfg.SamplingParams(temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True)
    passes = [_serve_pass(engine, prompts, params) for _ in range(1 + repeats)]
    cold, timed = passes[0], passes[1:]
    assert all(p["outputs"] == cold["outputs"] for p in timed), "outputs changed between passes"
    return {**out, "ttft_cold_s": cold["ttft_s"], "ttft_cold_first_s": cold["ttft_first_s"],
            "cold_compile_s": clock["compile_s"] - out["warmup_compile_s"] if clock else None,
            "cache_hits": clock.get("cache_hits"), "cold_total_s": cold["total_s"],
            "ttft_s": statistics.median(p["ttft_s"] for p in timed),
            "decode_tps": statistics.median(p["decode_tokens"] / p["decode_s"] for p in timed),
            "outputs": cold["outputs"], "prompt_tokens": sum(map(len, prompts)),
            "num_compilations": engine.stats()["num_compilations"]}


def _serve_pass(engine, prompts, params) -> dict:
    rids = [f"p{engine.num_steps}-{i}" for i in range(len(prompts))]  # fresh ids on every pass
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    first, outputs, decode_s, decode_tokens, steps = {}, {}, 0.0, 0, 0
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) \
            and not engine.scheduler.waiting
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        if decoding:
            decode_s += now - t
            decode_tokens += len(outs)
        for o in outs:
            if o.output_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
                if len(first) == len(rids):
                    prefill_steps = steps
            if o.finished:
                outputs[o.request_id] = list(o.output_token_ids)
    return {"ttft_s": statistics.median(first[r] for r in rids), "ttft_first_s": first[rids[0]],
            "decode_s": decode_s, "decode_tokens": decode_tokens, "total_s": time.perf_counter() - t0,
            "prefill_steps": prefill_steps, "outputs": [outputs[r] for r in rids]}


def curve(side: str, scale: str, points: list[int]) -> dict:
    """The throughput curve: for each number of requests N, a fresh engine (max_num_seqs N), N ragged prompts
    arriving at once, G greedy tokens each; one pass as warm-up (the JAX compiles), one timed pass."""
    model_dir, s = checkpoint(scale), SHAPES[scale]
    out = {}
    for n in points:
        t0 = time.perf_counter()
        prompts = _serve_prompts(model_dir, scale, n)
        engine, cfg = _engine(side, model_dir, _engine_kw(scale, n))
        params = cfg.SamplingParams(temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True)
        cold = _serve_pass(engine, prompts, params)
        warm = _serve_pass(engine, prompts, params)
        assert warm["outputs"] == cold["outputs"], f"{n} requests: outputs changed between passes"
        out[n] = {"ttft_s": warm["ttft_s"], "ttft_cold_s": cold["ttft_s"],
                  "decode_tps": warm["decode_tokens"] / warm["decode_s"] if warm["decode_s"] else 0.0,
                  "decode_steps_tokens": warm["decode_tokens"], "prefill_steps": warm["prefill_steps"],
                  "prompt_tokens": sum(map(len, prompts)), "point_s": time.perf_counter() - t0,
                  "outputs": warm["outputs"]}
        print(f"[curve {side}] {n} requests: {out[n]['point_s']:.1f} s", file=sys.stderr, flush=True)
        del engine
    return out


def _profiled_pass(side: str, engine, prompts, params, clock: dict) -> dict:
    """One pass of the serve workload with its prefill steps (the steps up to every request's first token)
    taken apart: the scheduler, the runner's host work (batch metadata, sampling metadata, the read-back) and
    its model call (JAX: the jitted step until its results are ready, split into compile and run)."""
    import importlib
    mr = importlib.import_module("serving_engine.model_runner" if side == "jax"
                                 else "torch_sources.serving.model_runner")
    steps, cur = [], {}

    def wrap(obj, name, key, block=False):
        orig = getattr(obj, name)

        def timed(*a, **k):
            c0, t = clock.get("compile_s", 0.0), time.perf_counter()
            res = orig(*a, **k)
            if block:
                import jax
                jax.block_until_ready(res)
            cur[key] = cur.get(key, 0.0) + time.perf_counter() - t
            if block:
                cur["compile_s"] = cur.get("compile_s", 0.0) + clock.get("compile_s", 0.0) - c0
            return res
        setattr(obj, name, timed)
        return lambda: setattr(obj, name, orig)
    undo = [wrap(engine.scheduler, "schedule", "schedule_s"), wrap(engine.runner, "execute_model", "runner_s"),
            wrap(engine.scheduler, "update_from_output", "update_s")]
    if side == "jax":
        undo.append(wrap(mr, "_step", "model_s", block=True))
    orig_bbm = mr.build_batch_metadata

    def bbm(*a, **k):
        batch = orig_bbm(*a, **k)
        cur.update(tokens=batch.num_tokens, padded=batch.padded_num_tokens)
        return batch
    mr.build_batch_metadata = bbm
    try:
        rids = [f"q{engine.num_steps}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        for rid, p in zip(rids, prompts):
            engine.add_request(rid, p, params)
        first = {}
        while len(first) < len(rids):
            cur.clear()
            t = time.perf_counter()
            outs = engine.step()
            cur["step_s"] = time.perf_counter() - t
            steps.append(dict(cur))
            first.update((o.request_id, time.perf_counter() - t0) for o in outs
                         if o.output_token_ids and o.request_id not in first)
        engine.abort_request(rids)  # the decode is the serve workload's business
    finally:
        mr.build_batch_metadata = orig_bbm
        for u in undo:
            u()
    for st in steps:
        st["host_s"] = st.get("runner_s", 0.0) - st.get("model_s", st.get("runner_s", 0.0))
    return {"ttft_s": statistics.median(first.values()), "steps": steps}


def prefill_profile(side: str, scale: str, jax_cache: str = "") -> dict:
    """Where the time to first token goes on the serve workload's prompts: a cold pass (fresh engine, compiles
    in the path), a warm pass, and (JAX) the same warm prefill under other token-bucket grids (the padding
    of the prompt tokens to a power of two)."""
    s, prompts, kw, clock, engine, cfg, build_s = _fresh_engine(side, scale, jax_cache)
    out = {"build_s": build_s, "prompt_tokens": sum(map(len, prompts))}
    params = cfg.SamplingParams(temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True)
    out["cold"] = _profiled_pass(side, engine, prompts, params, clock)
    out["warm"] = _profiled_pass(side, engine, prompts, params, clock)
    if side == "jax":
        total = out["prompt_tokens"]
        grids = {"x128": [16, 32, 64] + list(range(128, 4097, 128)), "exact": [16, total]}
        for name, grid in grids.items():
            engine, cfg = _engine(side, checkpoint(scale), kw, token_buckets=grid)
            _profiled_pass(side, engine, prompts, params, clock)  # compiles this grid's bucket
            out[name] = _profiled_pass(side, engine, prompts, params, clock)
            del engine
    return out


def roof() -> dict:
    """This machine's ceilings as JAX reaches them: fp32 matmul FLOP/s (a 2048 x 2048 x 2048 product, precision
    highest) and read bandwidth (the sum of a 512 MiB array, far past the caches)."""
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_default_matmul_precision", "highest")
    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), np.float32))
    big = jnp.ones((2 ** 27,), jnp.float32)
    mm, total = jax.jit(lambda x: x @ x), jax.jit(jnp.sum)

    def best(f, x):
        jax.block_until_ready(f(x))
        return min(_timed_once(f, x) for _ in range(5))
    return {"matmul_flops": 2 * 2048 ** 3 / best(mm, a), "read_bytes_per_s": big.nbytes / best(total, big)}


def _timed_once(f, x) -> float:
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    return time.perf_counter() - t0


def model_costs(model_dir: Path, scale: str) -> dict:
    """Analytic work of the workloads, from config.json (Llama-shaped): matmul weights P (every projection and
    the head), an SFT step's FLOPs (forward 2PN, the input-gradient backward 2PN, dense causal attention
    forward and backward), bytes of fp32 weights a decode step reads."""
    c, s = json.loads((model_dir / "config.json").read_text()), SHAPES[scale]
    d, hd, layers = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * c["intermediate_size"]
    p = layers * per_layer + d * c["vocab_size"]
    n, t = s["rows"] * s["length"], s["length"]
    attention = 2 * 2 * s["rows"] * c["num_attention_heads"] * t * t * hd * layers  # QK^T and PV, forward
    return {"matmul_params": p, "sft_step_flops": 4 * p * n + 3 * attention, "decode_step_bytes": 4 * p}


def worker(workload: str, side: str, scale: str, threads: int, steps: int, opts: dict) -> dict:
    if side == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls, as the oracles grade
    if workload == "roof":
        return roof()
    if workload == "serve":
        result = serve(side, scale, steps, opts.get("warmup", False), opts.get("jax_cache", ""))
    elif workload == "curve":
        result = {str(k): v for k, v in curve(side, scale, opts["points"]).items()}
    elif workload == "prefill":
        result = prefill_profile(side, scale, opts.get("jax_cache", ""))
    else:
        step = {"sft": sft_step, "dpo": dpo_step, "ppo": ppo_step}[workload](side, scale)
        times = _timed(step, steps)
        result = {"step_s": min(times), "median_s": statistics.median(times)}
    return {**result, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ---- the side-by-side run -------------------------------------------------------------------------

def _run_worker(workload, side, scale, threads, steps, **opts) -> dict:
    cmd = [sys.executable, __file__, "--worker", workload, "--side", side, "--scale", scale,
           "--threads", str(threads), "--steps", str(steps), "--opts", json.dumps(opts)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{workload}/{side} failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _cache_entries(path: str) -> int:
    return sum(1 for f in Path(path).rglob("*") if f.is_file()) if path and Path(path).is_dir() else 0


def _serve_report(a, threads, ceil, cost) -> None:
    torch_runs = {n: _run_worker("serve", "torch", a.scale, n, a.steps) for n in threads}
    j = _run_worker("serve", "jax", a.scale, 1, a.steps)  # the engine as it ships: no warm-up, no persistent cache
    n, t = max(torch_runs.items(), key=lambda kv: kv[1]["decode_tps"])
    print(f"serve  ttft ms cold: torch({n}t) {_ms(t['ttft_cold_s']):>6}  jax {_ms(j['ttft_cold_s']):>6} | warm: "
          f"torch({n}t) {_ms(t['ttft_s']):>6}  jax {_ms(j['ttft_s']):>6}  jax/torch {j['ttft_s'] / t['ttft_s']:.2f} | "
          f"decode tok/s: torch({n}t) {t['decode_tps']:7.1f}  jax {j['decode_tps']:7.1f}  "
          f"jax/torch {j['decode_tps'] / t['decode_tps']:.2f}x | peak GiB torch {_gib(t['peak_rss_bytes'])} "
          f"jax {_gib(j['peak_rss_bytes'])} | greedy outputs identical: {t['outputs'] == j['outputs']}", flush=True)
    print(f"       cold = the first pass of a fresh engine in a fresh process ({j['prompt_tokens']} prompt tokens); "
          f"jax compiled {j['cold_compile_s']:.1f} s in its cold pass (prefill and decode variants; "
          f"{j['num_compilations']} compilations in all); "
          f"engine build s: torch {t['build_s']:.1f} jax {j['build_s']:.1f}", flush=True)
    rows = SHAPES[a.scale]["requests"]  # a decode step reads every weight once for all rows
    floor = max(cost["decode_step_bytes"] / ceil["read_bytes_per_s"],
                2 * cost["matmul_params"] * rows / ceil["matmul_flops"])
    print(f"       decode roof {rows / floor:.0f} tok/s (weights {cost['decode_step_bytes'] / 1e6:.0f} MB a step "
          f"at the read bandwidth, or {rows} rows of matmul at the FLOP roof, whichever is slower): jax at "
          f"{j['decode_tps'] * floor / rows:.0%}", flush=True)
    if not a.serve_warmup:
        return
    # Warm-up at engine start (dummy requests through the public API) and JAX's persistent compilation cache.
    tw = _run_worker("serve", "torch", a.scale, n, a.steps, warmup=True)
    before = _cache_entries(a.jax_cache)
    starts = [_run_worker("serve", "jax", a.scale, 1, a.steps, warmup=True, jax_cache=a.jax_cache)]
    if a.jax_cache and before == 0:  # the first start filled the cache: a restart reads it
        starts.append(_run_worker("serve", "jax", a.scale, 1, a.steps, warmup=True, jax_cache=a.jax_cache))
    print(f"       with warm-up at engine start (dummy requests, public API; jax persistent cache "
          f"{a.jax_cache or 'off'}, {before} entries before):", flush=True)
    print(f"       torch({n}t): warm-up {tw['warmup_s']:.1f} s ({tw['warmup_steps']} steps) | ttft ms cold "
          f"{_ms(tw['ttft_cold_s'])} warm {_ms(tw['ttft_s'])} | decode tok/s {tw['decode_tps']:.1f} | outputs as "
          f"without warm-up: {tw['outputs'] == t['outputs']}", flush=True)
    for i, jw in enumerate(starts):
        label = ("start, cache empty" if before == 0 and a.jax_cache else "start") if i == 0 else "restart"
        print(f"       jax ({label}): warm-up {jw['warmup_s']:.1f} s ({jw['warmup_steps']} steps; compile "
              f"{jw['warmup_compile_s']:.1f} s, {jw['cache_hits']} cache hits) | ttft ms cold {_ms(jw['ttft_cold_s'])} "
              f"(compile in it {jw['cold_compile_s']:.1f} s) warm {_ms(jw['ttft_s'])} | jax/torch cold "
              f"{jw['ttft_cold_s'] / tw['ttft_cold_s']:.2f} warm {jw['ttft_s'] / tw['ttft_s']:.2f} | decode tok/s "
              f"{jw['decode_tps']:.1f} | outputs as torch's: {jw['outputs'] == t['outputs']} | process "
              f"{jw['process_s']:.0f} s", flush=True)


def _curve_report(a, threads, ceil, cost) -> None:
    import curve as cv
    points = [int(x) for x in a.curve_requests.split(",")]
    print(f"curve  ragged prompts {SHAPES[a.scale]['prompt'][0]}-{SHAPES[a.scale]['prompt'][1] - 1} tokens, all at "
          f"once, {SHAPES[a.scale]['new_tokens']} greedy tokens each; per point a fresh engine (max_num_seqs = "
          f"requests), one warm-up pass, then the timed pass; roof: min(read bandwidth, FLOP roof) for R rows",
          flush=True)
    print(cv.table_head(), flush=True)
    rows = []
    for p in points:
        torch_runs = {n: _run_worker("curve", "torch", a.scale, n, a.steps, points=[p])[str(p)] for n in threads}
        j = _run_worker("curve", "jax", a.scale, 1, a.steps, points=[p])[str(p)]
        n, t = max(torch_runs.items(), key=lambda kv: kv[1]["decode_tps"])
        roof = cv.decode_roof(p, cost["decode_step_bytes"], cost["matmul_params"], ceil["read_bytes_per_s"],
                              ceil["matmul_flops"])
        rows.append(cv.row(p, n, t, j, roof))
        print(cv.format_row(rows[-1]), flush=True)
    png = cv.plot(rows, ROOT / "reports" / "bench" / f"curve-{a.scale}.png",
                  f"llama3 {a.scale}, ragged, {SHAPES[a.scale]['new_tokens']} greedy tokens per request, "
                  f"torch at its faster of {a.torch_threads} threads")
    (png.with_suffix(".json")).write_text(json.dumps(rows, indent=1))
    print(f"       {png.relative_to(ROOT)} (and .json); greedy outputs identical at every point: "
          f"{all(r['identical'] for r in rows)}", flush=True)
    bad = [r["requests"] for r in rows if not r["identical"]]
    if bad:
        raise SystemExit(f"curve: greedy outputs differ between torch and jax at {bad} requests")


def _prefill_report(a) -> None:
    t = _run_worker("prefill", "torch", a.scale, max(int(x) for x in a.torch_threads.split(",")), a.steps)
    j = _run_worker("prefill", "jax", a.scale, 1, a.steps)

    def steps(p):
        return " + ".join(f"{st.get('tokens', 0)}->{st.get('padded', st.get('tokens', 0))} tok "
                          f"{st['step_s'] * 1e3:.0f} ms" for st in p["steps"])

    def split(p):
        st = p["steps"]
        total = lambda k: sum(x.get(k, 0.0) for x in st)  # noqa: E731
        model = total("model_s")
        return (f"schedule {total('schedule_s') * 1e3:.1f} ms, runner host {total('host_s') * 1e3:.1f} ms, model "
                f"call {model * 1e3:.0f} ms (compile {total('compile_s') * 1e3:.0f}, run "
                f"{(model - total('compile_s')) * 1e3:.0f}), update {total('update_s') * 1e3:.1f} ms")
    print(f"prefill  {j['prompt_tokens']} prompt tokens, {SHAPES[a.scale]['requests']} requests at once "
          f"(ragged: each prompt whole); ttft = median over requests", flush=True)
    print(f"       torch({max(int(x) for x in a.torch_threads.split(','))}t) cold ttft {_ms(t['cold']['ttft_s'])} ms "
          f"[{steps(t['cold'])}], warm {_ms(t['warm']['ttft_s'])} ms [{steps(t['warm'])}]", flush=True)
    for k in ("cold", "warm"):
        print(f"       jax {k}: ttft {_ms(j[k]['ttft_s'])} ms [{steps(j[k])}]: {split(j[k])}", flush=True)
    for k, what in (("x128", "buckets of 128 tokens"), ("exact", "a bucket of exactly the prompt tokens")):
        print(f"       jax warm, {what}: ttft {_ms(j[k]['ttft_s'])} ms [{steps(j[k])}]: {split(j[k])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SHAPES), default="small")
    ap.add_argument("--only", default=",".join(WORKLOADS),
                    help=f"comma-separated workloads (default {','.join(WORKLOADS)}; also {','.join(EXTRA)})")
    ap.add_argument("--torch-threads", default="1,2", help="torch intra-op thread counts; the fastest is compared")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (serve: timed passes) after a warm-up")
    ap.add_argument("--curve-requests", default="1,4,16,64", help="curve: numbers of requests, one point each")
    ap.add_argument("--no-serve-warmup", dest="serve_warmup", action="store_false",
                    help="serve: skip the runs with a warm-up at engine start")
    ap.add_argument("--jax-cache", default=str(ROOT / "reports" / "bench" / "jax-cache"),
                    help="serve's warm-up runs: JAX's persistent compilation cache directory ('' = off)")
    ap.add_argument("--worker", choices=WORKLOADS + EXTRA + PROBES, help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("torch", "jax"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.side, a.scale, a.threads, a.steps, json.loads(a.opts))))
        return

    import jax
    checkpoint(a.scale), checkpoint(a.scale, "llama3-reward")  # written once, before anything is timed
    print(f"scale={a.scale} ({SHAPES[a.scale]}), llama3; {os.cpu_count()} CPUs; JAX backend {jax.default_backend()}; "
          f"best of {a.steps} after a warm-up, torch at threads {a.torch_threads} (fastest compared)", flush=True)
    threads = [int(t) for t in a.torch_threads.split(",")]
    ceil, cost = _run_worker("roof", "jax", a.scale, 1, a.steps), model_costs(checkpoint(a.scale), a.scale)
    print(f"roof   matmul {ceil['matmul_flops'] / 1e9:.0f} GFLOP/s fp32, read {ceil['read_bytes_per_s'] / 1e9:.1f} GB/s; "
          f"model {cost['matmul_params'] / 1e6:.0f}M matmul weights; SFT step {cost['sft_step_flops'] / 1e12:.2f} TFLOP "
          f"-> compute floor {cost['sft_step_flops'] / ceil['matmul_flops'] * 1e3:.0f} ms", flush=True)
    for workload in a.only.split(","):
        if workload == "serve":
            _serve_report(a, threads, ceil, cost)
            continue
        if workload == "curve":
            _curve_report(a, threads, ceil, cost)
            continue
        if workload == "prefill":
            _prefill_report(a)
            continue
        torch_runs = {n: _run_worker(workload, "torch", a.scale, n, a.steps) for n in threads}
        j = _run_worker(workload, "jax", a.scale, 1, a.steps)
        n, t = min(torch_runs.items(), key=lambda kv: kv[1]["step_s"])
        others = ", ".join(f"{m}t {r['step_s'] * 1e3:.0f}" for m, r in torch_runs.items() if m != n)
        print(f"{workload:5s}  step ms: torch({n}t) {t['step_s'] * 1e3:8.1f}  jax {j['step_s'] * 1e3:8.1f}  "
              f"jax/torch {j['step_s'] / t['step_s']:.2f} | peak GiB torch {_gib(t['peak_rss_bytes'])} "
              f"jax {_gib(j['peak_rss_bytes'])} | torch at {others}", flush=True)
        if workload == "sft":
            floor = cost["sft_step_flops"] / ceil["matmul_flops"]
            print(f"       compute floor {floor * 1e3:.0f} ms: jax at {floor / j['step_s']:.0%} of the matmul roof, "
                  f"torch at {floor / t['step_s']:.0%}", flush=True)


if __name__ == "__main__":
    main()
