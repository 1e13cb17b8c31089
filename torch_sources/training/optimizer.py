"""AdamW and the warmup schedules of an HF Trainer run (`lr_scheduler_type` linear or cosine).

torch.optim.AdamW (decoupled decay p -= lr*wd*p, then the Adam step with eps outside the
square root), decay on every trainable weight except biases and norms (HF's
get_decay_parameter_names), grads clipped to max_grad_norm, and a LambdaLR stepped once per
optimizer step (transformers optimization.py / training_args.py). Its multiplier at step s
is s/W while s < W, W = ceil(T * warmup_ratio); then
  linear (HF's default):          max(0, (T - s) / (T - W))
  cosine (LLaMA-Factory's choice): max(0, (1 + cos(pi (s-W)/(T-W))) / 2)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["get_warmup_steps", "linear_lr_multiplier", "cosine_lr_multiplier", "LR_MULTIPLIERS",
           "get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup", "get_scheduler",
           "decay_parameter_names", "create_optimizer", "clip_grad_norm"]


def get_warmup_steps(num_training_steps: int, warmup_ratio: float) -> int:
    return math.ceil(num_training_steps * warmup_ratio)


def linear_lr_multiplier(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def cosine_lr_multiplier(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # num_cycles = 0.5


# HF's SchedulerType names (TrainingArguments.lr_scheduler_type) -> multiplier
LR_MULTIPLIERS = {"linear": linear_lr_multiplier, "cosine": cosine_lr_multiplier}


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    return get_scheduler("linear", optimizer, num_warmup_steps, num_training_steps)


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    return get_scheduler("cosine", optimizer, num_warmup_steps, num_training_steps)


def get_scheduler(name: str, optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    """transformers.get_scheduler for the two warmup schedules."""
    multiplier = LR_MULTIPLIERS[name]
    return LambdaLR(optimizer, lambda step: multiplier(step, num_warmup_steps, num_training_steps))


def decay_parameter_names(named_parameters) -> list[str]:
    return [n for n, _ in named_parameters if "bias" not in n and "norm" not in n]


def create_optimizer(named_parameters, args, num_training_steps: int):
    """(AdamW over the trainable params, its args.lr_scheduler_type LambdaLR) for an HF-style run of T steps."""
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    decay = set(decay_parameter_names(named))
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=args.weight_decay)
    warmup = get_warmup_steps(num_training_steps, args.warmup_ratio)
    return optimizer, get_scheduler(args.lr_scheduler_type, optimizer, warmup, num_training_steps)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """g *= min(1, max_norm / (||g|| + 1e-6)) over all grads; returns the pre-clip norm."""
    return nn.utils.clip_grad_norm_(list(parameters), max_norm)
