"""Steady-state time of one DPO optimizer step: torch_sources vs jax_oracles (LoRA on tiny Llama 3).

One step = GA micro-batches of 2B rows (chosen, then rejected), each a policy forward + backward and
a reference forward with the adapter disabled, then grad clip, AdamW, schedule: the loop body of
train_dpo, on the epoch-0 batches of the shipped preference data. Torch runs eagerly on batches padded
to a multiple of 8; JAX runs its one jitted step (policy and reference in one program) on batches
padded to the dataset's fixed length. Warm-up (and the JAX compile) excluded; rounds alternate between
the frameworks and the best round of each is reported, as bench_sft.py does.

    python bench/bench_dpo.py [--rounds 5] [--steps 8]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from jax_oracles.training import dpo as j_dpo
from jax_oracles.training.lora import init_lora_tree
from torch_sources.training import dpo as t_dpo

from side_by_side import report_step_times  # bench/, on sys.path as the script's own folder

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "dpo"


def torch_runner():
    args = t_dpo.DPOArgs()
    pairs = t_dpo.load_pairwise_dataset(TOKENIZER, DATA, "train", args)
    collate = t_dpo.make_collator(args, TOKENIZER)
    steps = [[collate([pairs[i] for i in idx]) for idx in step]
             for step in t_dpo.step_example_indices(len(pairs), args, 0)]
    model = t_dpo.load_model(MODEL, t_dpo.lora_config(args), args.seed)
    model.train()
    optimizer, scheduler = t_dpo.create_optimizer(model.named_parameters(), args, 10 ** 6)

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            t_dpo._train_step(model, optimizer, scheduler, steps[i % len(steps)], args)
        return time.perf_counter() - start

    return run


def jax_runner():
    args = j_dpo.DPOArgs()
    pairs = j_dpo.load_pairwise_dataset(TOKENIZER, DATA, "train", args)
    length = j_dpo._bucket_length(pairs)
    collate = j_dpo.make_collator(args, TOKENIZER)
    shape = (args.gradient_accumulation_steps, args.per_device_train_batch_size, length)
    steps = [j_dpo._stack_step([collate([pairs[i] for i in idx]) for idx in step], *shape, collate.pad_token_id)
             for step in j_dpo.step_example_indices(len(pairs), args, 0)]
    model = j_dpo.load_model(MODEL, j_dpo.lora_config(args))
    state = {"lora": init_lora_tree(model.params, j_dpo.lora_config(args), args.seed)}
    tx = j_dpo._lora_optimizer(args, 10 ** 6)
    step_fn = j_dpo._train_step_fn(model.module, args, tx)
    state["opt"] = tx.init(state["lora"])

    def run(num_steps: int) -> float:
        start = time.perf_counter()
        for i in range(num_steps):
            batches = {k: np.asarray(v) for k, v in steps[i % len(steps)].items()}
            state["lora"], state["opt"], loss, _ = step_fn(model.params, state["lora"], state["opt"], batches)
        jax.block_until_ready(loss)
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per round")
    opts = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    report_step_times({"torch": torch_runner(), "jax": jax_runner()}, opts.rounds, opts.steps, 2, "DPO")


if __name__ == "__main__":
    main()
