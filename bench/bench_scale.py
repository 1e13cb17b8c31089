"""torch source vs JAX oracle at one scale, side by side: `make bench SCALE=small`.

    python bench/bench_scale.py [--scale small] [--only sft,dpo,ppo,serve] [--torch-threads 1,2] [--steps 3]

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
  G new tokens each, greedy: time to first token (median over requests, warm engine) and decode tokens/s
  (steps in which every scheduled request decodes).
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


def serve(side: str, scale: str, repeats: int) -> dict:
    model_dir, s = checkpoint(scale), SHAPES[scale]
    rng = np.random.default_rng(0)
    vocab = min(_vocab(model_dir), 400)  # ids below the tokenizer's specials: no prompt hits an EOS
    prompts = [rng.integers(0, vocab, int(rng.integers(*s["prompt"]))).tolist() for _ in range(s["requests"])]
    kw = dict(mode="ragged", block_size=16, max_num_seqs=s["requests"], max_model_len=s["model_len"],
              num_blocks=s["requests"] * s["model_len"] // 16 + 16, max_num_batched_tokens=4096)
    if side == "torch":
        from torch_sources.serving import config as cfg
        from torch_sources.serving.engine import LLMEngine
    else:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
        from serving_engine import config as cfg
        from serving_engine.engine import LLMEngine
    engine = LLMEngine(str(model_dir), cfg.EngineConfig(**kw))
    params = cfg.SamplingParams(temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True)
    passes = [_serve_pass(engine, prompts, params) for _ in range(1 + repeats)]  # the first: warm-up (compiles)
    timed = passes[1:]
    assert all(p["outputs"] == passes[0]["outputs"] for p in timed), "outputs changed between passes"
    return {"ttft_s": statistics.median(p["ttft_s"] for p in timed),
            "decode_tps": statistics.median(p["decode_tokens"] / p["decode_s"] for p in timed),
            "warmup_s": passes[0]["total_s"], "outputs": passes[0]["outputs"],
            "prompt_tokens": sum(map(len, prompts))}


def _serve_pass(engine, prompts, params) -> dict:
    rids = [f"p{engine.num_steps}-{i}" for i in range(len(prompts))]  # fresh ids on every pass
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    first, outputs, decode_s, decode_tokens = {}, {}, 0.0, 0
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) \
            and not engine.scheduler.waiting
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        if decoding:
            decode_s += now - t
            decode_tokens += len(outs)
        for o in outs:
            if o.output_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
            if o.finished:
                outputs[o.request_id] = list(o.output_token_ids)
    return {"ttft_s": statistics.median(first[r] for r in rids), "decode_s": decode_s,
            "decode_tokens": decode_tokens, "total_s": time.perf_counter() - t0,
            "outputs": [outputs[r] for r in rids]}


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


def worker(workload: str, side: str, scale: str, threads: int, steps: int) -> dict:
    if side == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls, as the oracles grade
    if workload == "roof":
        return roof()
    if workload == "serve":
        result = serve(side, scale, steps)
    else:
        step = {"sft": sft_step, "dpo": dpo_step, "ppo": ppo_step}[workload](side, scale)
        times = _timed(step, steps)
        result = {"step_s": min(times), "median_s": statistics.median(times)}
    return {**result, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ---- the side-by-side run -------------------------------------------------------------------------

def _run_worker(workload, side, scale, threads, steps) -> dict:
    cmd = [sys.executable, __file__, "--worker", workload, "--side", side, "--scale", scale,
           "--threads", str(threads), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{workload}/{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SHAPES), default="small")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    ap.add_argument("--torch-threads", default="1,2", help="torch intra-op thread counts; the fastest is compared")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (serve: timed passes) after a warm-up")
    ap.add_argument("--worker", choices=WORKLOADS + PROBES, help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("torch", "jax"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.side, a.scale, a.threads, a.steps)))
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
        torch_runs = {n: _run_worker(workload, "torch", a.scale, n, a.steps) for n in threads}
        j = _run_worker(workload, "jax", a.scale, 1, a.steps)
        if workload == "serve":
            n, t = max(torch_runs.items(), key=lambda kv: kv[1]["decode_tps"])
            print(f"serve  ttft ms: torch({n}t) {t['ttft_s'] * 1e3:8.1f}  jax {j['ttft_s'] * 1e3:8.1f} | "
                  f"decode tok/s: torch({n}t) {t['decode_tps']:7.1f}  jax {j['decode_tps']:7.1f}  "
                  f"jax/torch {j['decode_tps'] / t['decode_tps']:.2f}x | peak GiB torch {_gib(t['peak_rss_bytes'])} "
                  f"jax {_gib(j['peak_rss_bytes'])} | greedy outputs identical: {t['outputs'] == j['outputs']}",
                  flush=True)
            rows = SHAPES[a.scale]["requests"]  # a decode step reads every weight once for all rows
            floor = max(cost["decode_step_bytes"] / ceil["read_bytes_per_s"],
                        2 * cost["matmul_params"] * rows / ceil["matmul_flops"])
            print(f"       decode roof {rows / floor:.0f} tok/s (weights {cost['decode_step_bytes'] / 1e6:.0f} MB a step "
                  f"at the read bandwidth, or {rows} rows of matmul at the FLOP roof, whichever is slower): jax at "
                  f"{j['decode_tps'] * floor / rows:.0%}", flush=True)
            continue
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
