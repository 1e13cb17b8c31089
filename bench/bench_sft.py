"""Steady-state time of one SFT optimizer step: torch_sources vs jax_oracles (LoRA on tiny Llama 3).

One step = GA micro-batches of forward + backward, grad clip, AdamW, schedule: the loop body of
train_sft, on the epoch-0 batches of the shipped dataset. Torch runs eagerly on batches padded
to a multiple of 8 (as its train_sft does); JAX runs its one jitted step on batches padded to
the dataset's fixed length (as its train_sft does). Warm-up steps (and the JAX compile) are
excluded; rounds of the two frameworks alternate so that a change in machine load hits both,
and the best round of each is reported (the least disturbed one).

    python bench/bench_sft.py [--rounds 5] [--e2e]

--e2e also times one train_sft per framework (cold: the JAX figure includes its compiles).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from jax_oracles.training import sft as j_sft
from jax_oracles.training.lora import init_lora_tree
from torch_sources.training import sft as t_sft

from side_by_side import report_step_times  # bench/, on sys.path as the script's own folder

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "sft"


def torch_runner():
    args = t_sft.TrainArgs()
    feats = t_sft.load_processed_dataset(TOKENIZER, DATA, "train", args)
    collate = t_sft.make_collator(args, TOKENIZER)
    steps = [[collate([feats[i] for i in idx]) for idx in step] for step in t_sft.step_example_indices(len(feats), args, 0)]
    model = t_sft.load_model(MODEL, t_sft.lora_config(args), args.seed)
    model.train()
    optimizer, scheduler = t_sft.create_optimizer(model.named_parameters(), args, 10 ** 6)

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            t_sft._train_step(model, optimizer, scheduler, steps[i % len(steps)], args.max_grad_norm)
        return time.perf_counter() - start

    return run


def jax_runner():
    args = j_sft.TrainArgs()
    feats = j_sft.load_processed_dataset(TOKENIZER, DATA, "train", args)
    length = j_sft._bucket_length(feats)
    collate = j_sft.make_collator(args, TOKENIZER, pad_to_length=length)
    shape = (args.gradient_accumulation_steps, args.per_device_train_batch_size, length)
    steps = [j_sft._stack_step([collate([feats[i] for i in idx]) for idx in step], *shape, collate.pad_token_id)
             for step in j_sft.step_example_indices(len(feats), args, 0)]
    model = j_sft.load_model(MODEL, j_sft.lora_config(args))
    state = {"lora": init_lora_tree(model.params, j_sft.lora_config(args), args.seed)}
    tx = j_sft._lora_optimizer(args, 10 ** 6)
    step_fn = j_sft._train_step_fn(model.module, tx)
    state["opt"] = tx.init(state["lora"])

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            # host-side batch building is part of the JAX loop too (train_sft stacks each step)
            batches = {k: np.asarray(v) for k, v in steps[i % len(steps)].items()}
            state["lora"], state["opt"], loss = step_fn(model.params, state["lora"], state["opt"], batches)
        jax.block_until_ready(loss)
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per round")
    parser.add_argument("--e2e", action="store_true", help="also time one train_sft per framework")
    opts = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")

    if opts.e2e:  # first, so the JAX run pays its compiles as a fresh train_sft would
        for name, sft in (("torch", t_sft), ("jax", j_sft)):
            result = sft.train_sft(MODEL, TOKENIZER, DATA, sft.TrainArgs())
            print(f"{name:5s} train_sft wall s {result.wall_clock_s:6.2f}  "
                  f"held-out loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}")
    report_step_times({"torch": torch_runner(), "jax": jax_runner()}, opts.rounds, opts.steps, 3, "SFT")


if __name__ == "__main__":
    main()
