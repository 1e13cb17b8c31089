"""Training L6: the held-out loss, computed by the grader from the candidate's logits.

The candidate never reports the number that is scored. The grader hands its L6 child the
adapter the candidate's own L5 run produced (`adapter.<PEFT name>`) and the held-out batches the
recorder formed as the torch source's evaluation does (`b<i>.input_ids`, `b<i>.attention_mask`;
the labels stay with the grader); the child returns `b<i>.logits` from the candidate's public
forward, and `eval_loss` below turns them into HF Trainer.evaluate's eval_loss:

- per batch, HF `prediction_step`: ForCausalLMLoss with num_items_in_batch = that batch's own
  labelled tokens, i.e. the token mean of the cross entropy of logits[:, :-1] against
  labels[:, 1:] over labels != -100;
- over batches, `evaluation_loop`: each batch's loss repeated eval_batch_size times (the
  configured size, a short last batch too), non-finite ones dropped (logging_nan_inf_filter)
  unless all are, then the mean (`mean_of_batch_losses` in torch_sources/training/sft.py).

float64 throughout, with a max-shifted log-softmax. Numpy only: the grader parent runs this on
untrusted arrays, so every shape is checked before use and any problem is a HeldoutError whose
text is the check's reason.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["ADAPTER_KEY", "HELDOUT_KEY", "IGNORE_INDEX", "HeldoutError", "adapter_inputs", "batch_loss",
           "child_inputs", "eval_loss", "heldout_loss"]

IGNORE_INDEX = -100
ADAPTER_KEY = "L5/e2e_adapter"  # whose produced outputs the L6 child runs with
HELDOUT_KEY = "L6/heldout_loss"
_BATCH = re.compile(r"b(\d+)\.(\w+)")


class HeldoutError(ValueError):
    """The candidate's logits or adapter cannot be scored; the message is the check's reason."""


def batch_loss(logits, labels) -> float:
    """logits f[B,T,V], labels int[B,T] -> the batch's token-mean CE over the shifted labels (NaN
    when no label survives the shift, as torch's 0 / 0)."""
    x = np.asarray(logits, np.float64)[:, :-1]  # f64[B,T-1,V]: position t predicts label t+1
    y = np.asarray(labels, np.int64)[:, 1:]     # i64[B,T-1]
    keep = y != IGNORE_INDEX
    if not keep.any():
        return float("nan")
    rows, target = x[keep], y[keep]  # f64[N,V], i64[N]
    top = rows.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=-1))
    nll = log_z - rows[np.arange(len(target)), target]
    return float(nll.sum() / len(target))


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
    """What the L6 child gets: each batch's input_ids and attention_mask, and the adapter. The labels
    and the batch size stay here: the child returns logits, the loss is the grader's."""
    batches = _batches(recorded)
    return {**{f"b{i}.{f}": b[f] for i, b in sorted(batches.items()) for f in ("input_ids", "attention_mask")},
            **adapter}


def heldout_loss(recorded: dict, produced: dict) -> tuple[float, list[tuple[int, ...]]]:
    """(the grader's eval_loss, the shape of each batch's logits) from the recorded L6 inputs and the
    child's outputs; HeldoutError when the logits are missing, misshapen or not finite."""
    batches = _batches(recorded)
    logits, labels, shapes = [], [], []
    for i in sorted(batches):
        name = f"b{i}.logits"
        if name not in produced:
            raise HeldoutError(f"missing output {name!r}")
        x, y = np.asarray(produced[name]), batches[i]["labels"]
        if x.dtype.kind != "f" or x.ndim != 3 or x.shape[:2] != y.shape or x.shape[2] <= int(y.max(initial=0)):
            raise HeldoutError(f"{name} is {x.dtype}{list(x.shape)}; expected float [{y.shape[0]}, {y.shape[1]}, "
                               f"vocab]")
        if shapes and x.shape[2] != shapes[0][2]:
            raise HeldoutError(f"{name} has vocab {x.shape[2]}, b0.logits {shapes[0][2]}")
        if not np.all(np.isfinite(x)):
            raise HeldoutError(f"non-finite values in {name!r}")
        logits.append(x)
        labels.append(y)
        shapes.append(tuple(int(d) for d in x.shape))
    extra = sorted(set(produced) - {f"b{i}.logits" for i in batches})
    if extra:
        raise HeldoutError(f"unexpected outputs {extra[:3]}")
    return eval_loss(logits, labels, int(recorded["eval_batch_size"])), shapes
