"""Steady-state time of one PPO step: torch_sources vs jax_oracles (LoRA on tiny Llama 3, full reward model).

One step = the loop body of train_ppo: rollouts of batch_size prompts (generation of max_new_tokens, LF's
trimming, reward-model scores), then TRL's step (old and reference passes, rewards, GAE, whitening,
ppo_epochs x mini-batches with GA accumulation, clip, AdamW), on the epoch-0 prompt batches of the shipped
data. Torch runs eagerly (generation recomputes the forward per token, as the JAX twin does on its fixed
buffer); JAX runs its jitted rollout and its one jitted, donated step. Warm-up (and the compile) excluded;
rounds alternate and the best round of each is reported, as bench_sft.py does.

    python bench/bench_ppo.py [--rounds 3] [--steps 4]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jax_oracles.training import ppo as j_ppo
from torch_sources.training import ppo as t_ppo

from side_by_side import report_step_times  # bench/, on sys.path as the script's own folder

ROOT = Path(__file__).resolve().parents[1]
MODEL, REWARD = ROOT / "assets/checkpoints/llama3", ROOT / "assets/checkpoints/llama3-reward"
TOKENIZER, DATA = ROOT / "assets/tokenizer/llama3", ROOT / "assets/data/sft"


def torch_runner():
    args = t_ppo.PPOArgs()
    prompts = t_ppo.load_prompt_dataset(TOKENIZER, DATA, "train", args)
    steps = [[prompts[i] for i in idx] for idx in t_ppo.prompt_batch_indices(len(prompts), args, 0)]
    eos, pad = t_ppo.generation_ids(TOKENIZER, args)
    model, reward = t_ppo.load_policy(MODEL, args), t_ppo.load_reward_model(REWARD)
    optimizer, scheduler = t_ppo.create_optimizer(model.named_parameters(), args, 10 ** 6)
    kl_ctl = t_ppo.AdaptiveKLController(args.init_kl_coef, args.ppo_target, args.horizon)

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            q, r, s = t_ppo.rollout(model, reward, steps[i % len(steps)], args, eos, pad, i)
            t_ppo.ppo_step(model, optimizer, scheduler, kl_ctl, q, r, s, args, pad, i)
        return time.perf_counter() - start

    return run


def jax_runner():
    args = j_ppo.PPOArgs()
    prompts = j_ppo.load_prompt_dataset(TOKENIZER, DATA, "train", args)
    steps = [[prompts[i] for i in idx] for idx in j_ppo.prompt_batch_indices(len(prompts), args, 0)]
    width = j_ppo._prompt_width(prompts)
    eos, pad = j_ppo.generation_ids(TOKENIZER, args)
    policy, trainable = j_ppo.load_policy(MODEL, args)
    reward, reward_v_head = j_ppo.load_reward_model(REWARD)
    state = {"trainable": trainable, "opt": j_ppo._adam(args).init(trainable),
             "kl": jnp.asarray(args.init_kl_coef, jnp.float32)}

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            batch, _ = j_ppo.rollout(policy, state["trainable"]["lora"], reward, reward_v_head, steps[i % len(steps)],
                                     args, eos, pad, i, width)
            state["trainable"], state["opt"], state["kl"], stats = j_ppo.ppo_step(
                policy, state["trainable"], state["opt"], state["kl"], batch, args, i, 10 ** 6)
        jax.block_until_ready(stats)
        return time.perf_counter() - start

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    report_step_times({"torch": torch_runner(), "jax": jax_runner()}, a.rounds, a.steps, warmup=2, label="PPO")


if __name__ == "__main__":
    main()
