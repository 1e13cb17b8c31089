"""Training L6: the held-out loss (SFT) or preference loss and accuracy (DPO), computed by the grader from
the candidate's logits.

The candidate never reports the number that is scored. The grader hands its L6 child the
adapter the candidate's own L5 run produced (`adapter.<PEFT name>`) and the held-out batches the
recorder formed as the torch source's evaluation does (`b<i>.input_ids`, `b<i>.attention_mask`;
the labels stay with the grader); the child returns `b<i>.logits` from the candidate's public
forward, and `eval_loss` below turns them into HF Trainer.evaluate's eval_loss:

- per batch, HF `prediction_step`: ForCausalLMLoss with num_items_in_batch = that batch's own
  labelled positions (transformers 5.6, LF 0.9.5's: labels != -100 over every position), i.e. the
  cross entropy of logits[:, :-1] against labels[:, 1:] summed over labels != -100, divided by
  that count (the token mean, unless the first position is labelled: train_on_prompt);
- over batches, `evaluation_loop`: each batch's loss repeated eval_batch_size times (the
  configured size, a short last batch too), non-finite ones dropped (logging_nan_inf_filter)
  unless all are, then the mean (`mean_of_batch_losses` in torch_sources/training/sft.py).

DPO (`heldout_preference`): the child returns `b<i>.logits` under the adapter and `b<i>.ref_logits`
with the adapter disabled (the reference policy), both from the candidate's public forward, on the
recorded pairwise batches (chosen rows first); per batch, the sequence log-probs summed over the
shifted labels, TRL's sigmoid loss at the recorded beta (and label smoothing, and LF's ftx term) as
the mean over pairs, and the accuracy as the fraction of pairs whose chosen reward beta(logp -
ref logp) exceeds the rejected one; each is the mean over eval batches (LF's stored metrics, HF's
eval_loss of equal batches).

float64 throughout, with a max-shifted log-softmax. Numpy only: the grader parent runs this on
untrusted arrays, so every shape is checked before use and any problem is a HeldoutError whose
text is the check's reason.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["ADAPTER_KEY", "HELDOUT_KEY", "PREFERENCE_KEY", "REWARD_KEY", "IGNORE_INDEX", "HeldoutError",
           "adapter_inputs", "batch_loss", "child_inputs", "eval_loss", "heldout_loss", "sequence_logps",
           "preference_batch", "preference_metrics", "heldout_preference"]

IGNORE_INDEX = -100
ADAPTER_KEY = "L5/e2e_adapter"  # whose produced outputs the L6 child runs with
HELDOUT_KEY = "L6/heldout_loss"
PREFERENCE_KEY = "L6/heldout_preference"
REWARD_KEY = "L6/heldout_reward"  # PPO: scored by catalog/ppo_eval.py
_BATCH = re.compile(r"b(\d+)\.(\w+)")
# what the child's forward takes of a recorded batch (a vision-language batch: positions, pixels, grids too)
MODEL_FIELDS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "input_features",
                "feature_attention_mask", "token_type_ids", "image_sizes")


class HeldoutError(ValueError):
    """The candidate's logits or adapter cannot be scored; the message is the check's reason."""


def _token_logps(logits, labels) -> tuple[np.ndarray, np.ndarray]:
    """logits f[B,T,V], labels int[B,T] -> (log-prob of each shifted label f64[B,T-1], 0 where ignored;
    the label mask bool[B,T-1])."""
    x = np.asarray(logits, np.float64)[:, :-1]  # f64[B,T-1,V]: position t predicts label t+1
    y = np.asarray(labels, np.int64)[:, 1:]     # i64[B,T-1]
    keep = y != IGNORE_INDEX
    top = x.max(axis=-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(x - top).sum(axis=-1))
    picked = np.take_along_axis(x, np.where(keep, y, 0)[..., None], axis=-1)[..., 0]
    return np.where(keep, picked - log_z, 0.0), keep


def batch_loss(logits, labels) -> float:
    """logits f[B,T,V], labels int[B,T] -> the batch's CE summed over the shifted labels / its labelled
    positions before the shift (HF's num_items_in_batch; NaN when there are none, as torch's 0 / 0)."""
    logps, _ = _token_logps(logits, labels)
    count = int((np.asarray(labels) != IGNORE_INDEX).sum())
    if count == 0:
        return float("nan")
    return float(-logps.sum() / count)


def sequence_logps(logits, labels) -> tuple[np.ndarray, np.ndarray]:
    """LF's get_batch_logps: (log-probs summed over each row's labelled tokens f64[B], valid lengths i64[B])."""
    logps, keep = _token_logps(logits, labels)
    return logps.sum(axis=-1), keep.sum(axis=-1)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def preference_batch(logits, ref_logits, labels, beta: float, label_smoothing: float = 0.0,
                     ftx: float = 0.0) -> tuple[float, float]:
    """One pairwise batch [2N, T] (chosen rows first) -> (mean DPO sigmoid loss over its pairs, accuracy)."""
    logps, valid = sequence_logps(logits, labels)
    ref_logps, _ = sequence_logps(ref_logits, labels)
    n = len(logps) // 2
    chosen_rewards = beta * (logps[:n] - ref_logps[:n])
    rejected_rewards = beta * (logps[n:] - ref_logps[n:])
    h = (logps[:n] - ref_logps[:n]) - (logps[n:] - ref_logps[n:])
    losses = -_log_sigmoid(beta * h) * (1 - label_smoothing) - _log_sigmoid(-beta * h) * label_smoothing
    if ftx > 1e-6:
        losses = losses + ftx * -logps[:n] / valid[:n]
    return float(losses.mean()), float((chosen_rewards > rejected_rewards).mean())


def preference_metrics(batch_logits, batch_ref_logits, batch_labels, beta: float, label_smoothing: float = 0.0,
                       ftx: float = 0.0) -> dict[str, float]:
    """Held-out {"loss", "accuracy"}: each the mean over batches of the batch's value."""
    if not batch_labels or not len(batch_logits) == len(batch_ref_logits) == len(batch_labels):
        raise ValueError(f"{len(batch_logits)}/{len(batch_ref_logits)} logits batches for {len(batch_labels)} "
                         f"label batches")
    per_batch = [preference_batch(x, r, y, beta, label_smoothing, ftx)
                 for x, r, y in zip(batch_logits, batch_ref_logits, batch_labels)]
    return {"loss": float(np.mean([b[0] for b in per_batch])), "accuracy": float(np.mean([b[1] for b in per_batch]))}


def eval_loss(batch_logits, batch_labels, eval_batch_size: int) -> float:
    """HF Trainer.evaluate's eval_loss over batches in order (every batch weighs the same)."""
    if len(batch_logits) != len(batch_labels) or not batch_labels:
        raise ValueError(f"{len(batch_logits)} logits batches for {len(batch_labels)} label batches")
    if int(eval_batch_size) < 1:
        raise ValueError(f"eval_batch_size {eval_batch_size} < 1")
    losses = np.repeat([batch_loss(x, y) for x, y in zip(batch_logits, batch_labels)], int(eval_batch_size))
    finite = np.isfinite(losses)
    return float((losses[finite] if finite.any() else losses).mean())


def _batches(arrays: dict) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for name, value in arrays.items():
        m = _BATCH.fullmatch(name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = np.asarray(value)
    return out


def adapter_inputs(reference_adapter: dict, produced_adapter: dict) -> dict[str, np.ndarray]:
    """`adapter.<name>` inputs of the L6 child from the candidate's produced L5 adapter. Only the
    recorded names and shapes are taken from the reference (the contract), never its values."""
    missing = [k for k in reference_adapter if k not in produced_adapter]
    if missing:
        raise HeldoutError(f"the L5 adapter lacks {len(missing)} of its {len(reference_adapter)} matrices "
                           f"(first: {missing[0]})")
    bad = [k for k, ref in reference_adapter.items() if np.shape(produced_adapter[k]) != np.shape(ref)]
    if bad:
        k = bad[0]
        raise HeldoutError(f"the L5 adapter has {len(bad)} matrices of the wrong shape "
                           f"(first: {k} {np.shape(produced_adapter[k])}, expected {np.shape(reference_adapter[k])})")
    return {f"adapter.{k}": np.asarray(produced_adapter[k], np.float32) for k in reference_adapter}


def child_inputs(recorded: dict, adapter: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the L6 child gets: each batch's input_ids and attention_mask (and a vision-language batch's positions,
    pixels and grids), the generation settings (gen.*, PPO),
    and the adapter. The labels and the batch size stay here: the child returns logits (or responses), the
    score is the grader's."""
    batches = _batches(recorded)
    return {**{f"b{i}.{f}": b[f] for i, b in sorted(batches.items()) for f in MODEL_FIELDS if f in b},
            **{k: v for k, v in recorded.items() if k.startswith("gen.")}, **adapter}


def _produced_logits(recorded: dict, produced: dict, fields: tuple[str, ...]):
    """{field: [logits of batch i]} for each output field (b<i>.<field>), the labels per batch and the shapes;
    HeldoutError when an output is missing, misshapen, not finite, or not asked for."""
    batches = _batches(recorded)
    out, labels, shapes = {f: [] for f in fields}, [], []
    for i in sorted(batches):
        y = batches[i]["labels"]
        labels.append(y)
        for field in fields:
            name = f"b{i}.{field}"
            if name not in produced:
                raise HeldoutError(f"missing output {name!r}")
            x = np.asarray(produced[name])
            if x.dtype.kind != "f" or x.ndim != 3 or x.shape[:2] != y.shape or x.shape[2] <= int(y.max(initial=0)):
                raise HeldoutError(f"{name} is {x.dtype}{list(x.shape)}; expected float [{y.shape[0]}, "
                                   f"{y.shape[1]}, vocab]")
            if shapes and x.shape[2] != shapes[0][2]:
                raise HeldoutError(f"{name} has vocab {x.shape[2]}, b0.{fields[0]} {shapes[0][2]}")
            if not np.all(np.isfinite(x)):
                raise HeldoutError(f"non-finite values in {name!r}")
            out[field].append(x)
            shapes.append(tuple(int(d) for d in x.shape))
    extra = sorted(set(produced) - {f"b{i}.{f}" for i in batches for f in fields})
    if extra:
        raise HeldoutError(f"unexpected outputs {extra[:3]}")
    return out, labels, shapes


def heldout_loss(recorded: dict, produced: dict) -> tuple[float, list[tuple[int, ...]]]:
    """(the grader's eval_loss, the shape of each batch's logits) from the recorded L6 inputs and the
    child's outputs; HeldoutError when the logits are missing, misshapen or not finite."""
    out, labels, shapes = _produced_logits(recorded, produced, ("logits",))
    return eval_loss(out["logits"], labels, int(recorded["eval_batch_size"])), shapes


def heldout_preference(recorded: dict, produced: dict) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    """({"loss", "accuracy"} the grader computes, the shapes of the logits) from the recorded pairwise
    batches (and beta, label smoothing, ftx) and the child's policy and reference logits."""
    out, labels, shapes = _produced_logits(recorded, produced, ("logits", "ref_logits"))
    values = preference_metrics(out["logits"], out["ref_logits"], labels, float(recorded["beta"]),
                                float(recorded["label_smoothing"]), float(recorded["ftx"]))
    return values, shapes

