"""AdamW + warmup schedule + grad-norm clipping in optax, matching torch_sources/training/optimizer.py.

Torch's order per step: g *= min(1, max_norm / (||g|| + 1e-6)); p -= lr_s * wd * p;
p -= lr_s * m_hat / (sqrt(v_hat) + eps), lr_s = lr * multiplier(s) for optimizer step s.
optax.adamw is chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate): the update
-lr_s * (m_hat / (sqrt(v_hat) + eps) + wd * p) uses the pre-step p, so it is the same
arithmetic; its schedule is read at the pre-increment count, i.e. at s. Only the clip differs:
optax.clip_by_global_norm scales by max_norm / ||g|| without torch's +1e-6, so `clip_grad_norm`
here is torch's rule. The schedule is `lr_scheduler_type`'s (HF's linear or cosine, both with
the same warmup s/W).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

__all__ = ["get_warmup_steps", "linear_lr_multiplier", "cosine_lr_multiplier", "LR_MULTIPLIERS",
           "get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup", "get_scheduler",
           "decay_parameter_names", "create_optimizer", "clip_grad_norm"]


def get_warmup_steps(num_training_steps: int, warmup_ratio: float) -> int:
    return math.ceil(num_training_steps * warmup_ratio)


def _warmup_then(decay, step, num_warmup_steps: int):
    """s / W while s < W, then decay(s): the warmup both HF schedules share."""
    step = jnp.asarray(step, jnp.float32)
    warmup = step / max(1, num_warmup_steps)
    return jnp.where(step < num_warmup_steps, warmup, decay(step))


def linear_lr_multiplier(step, num_warmup_steps: int, num_training_steps: int):
    def decay(step):
        return jnp.maximum(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return _warmup_then(decay, step, num_warmup_steps)


def cosine_lr_multiplier(step, num_warmup_steps: int, num_training_steps: int):
    def decay(step):
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        return jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))  # num_cycles = 0.5

    return _warmup_then(decay, step, num_warmup_steps)


# HF's SchedulerType names (TrainingArguments.lr_scheduler_type) -> multiplier
LR_MULTIPLIERS = {"linear": linear_lr_multiplier, "cosine": cosine_lr_multiplier}


def get_linear_schedule_with_warmup(learning_rate: float, num_warmup_steps: int, num_training_steps: int):
    return get_scheduler("linear", learning_rate, num_warmup_steps, num_training_steps)


def get_cosine_schedule_with_warmup(learning_rate: float, num_warmup_steps: int, num_training_steps: int):
    return get_scheduler("cosine", learning_rate, num_warmup_steps, num_training_steps)


def get_scheduler(name: str, learning_rate: float, num_warmup_steps: int, num_training_steps: int):
    """optax schedule: count (optimizer steps taken) -> learning rate."""
    multiplier = LR_MULTIPLIERS[name]
    return lambda count: learning_rate * multiplier(count, num_warmup_steps, num_training_steps)


def decay_parameter_names(params) -> list[str]:
    """"/"-joined paths of the leaves that get weight decay (not biases, not norms)."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return [n for n in flat if "bias" not in n and "norm" not in n]


def _decay_mask(params):
    decay = set(decay_parameter_names(params))
    flat = traverse_util.flatten_dict(params, sep="/")
    return traverse_util.unflatten_dict({n: n in decay for n in flat}, sep="/")


def create_optimizer(args, num_training_steps: int, flatten: bool = False) -> optax.GradientTransformation:
    """clip (torch rule) then AdamW on the args.lr_scheduler_type schedule over num_training_steps.

    flatten=True runs the chain on one raveled vector (optax.flatten) and decays every element:
    for a LoRA tree (only A/B matrices, all decayed) it is the same arithmetic per element, and
    ~30 leaves x a dozen tiny ops become a few vector ops (a third of this tiny model's step on CPU).
    """
    warmup = get_warmup_steps(num_training_steps, args.warmup_ratio)
    schedule = get_scheduler(args.lr_scheduler_type, args.learning_rate, warmup, num_training_steps)
    adamw = optax.adamw(schedule, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon,
                        weight_decay=args.weight_decay, mask=None if flatten else _decay_mask)
    tx = optax.chain(clip_grad_norm(args.max_grad_norm), adamw) if args.max_grad_norm > 0 else adamw
    return optax.flatten(tx) if flatten else tx


def clip_grad_norm(max_norm: float) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_: g * min(1, max_norm / (||g||_2 + 1e-6))."""

    def update_fn(updates, state, params=None):
        del params
        norm = optax.global_norm(updates)
        coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
