"""LoRA DPO of Llama 3 as LLaMA-Factory runs it, in JAX/optax: twin of torch_sources/training/dpo.py.

Same pairwise data, same data order, optimizer and schedule as the SFT twin (sft.py), same loss:
per-sequence log-probs summed over response tokens, the reference = the same model without its
"lora" collection (`disable_adapter`), TRL's sigmoid loss (+ pref_ftx x the chosen mean NLL), the
micro-batch loss the mean over its pairs, divided by the step's micro-batch count (HF Trainer with
`model_accepts_loss_kwargs = False`), metrics averaged over micro-batches / eval batches.

One jitted train step does the whole accumulation step: a lax.scan over GA micro-batches of one
static shape [2B, L] (chosen rows 0..B-1, rejected rows B..2B-1), the policy and the reference
forward in the same program, then the optax update with the LoRA tree and optimizer state donated.
Pairs and micro-batches that pad a short step are masked out of every mean (`pair_mask`,
`micro_mask`); `columns` is the collated length torch would have seen, which only the raw-logits
mean metric depends on (a causal model's logits at t do not see the columns after t).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .collator import PairwiseDataCollator
from .loss import IGNORE_INDEX
from .lora import disable_adapter, init_lora_tree, lora_state_dict, lora_tree_from_state_dict
from .processor import preprocess_pairwise_dataset
from .sft import (CausalLM, TrainArgs, _embedded, _fake_media_length, _fixed_tokenizer, _forward, _lora_optimizer,
                  _pad_rows, _tower_features, load_model, lora_config, media_dir, multimodal_context,
                  num_training_steps, step_example_indices)

__all__ = ["DPOArgs", "DPOResult", "METRICS", "load_pairwise_dataset", "make_collator", "get_batch_logps",
           "dpo_loss", "concatenated_forward", "reference_log_probs", "batch_loss_metrics",
           "dpo_step_loss_metrics_and_grads", "train_steps", "train_dpo"]

_peft_state_dict = lora_state_dict  # for functions whose lora_state_dict argument shadows the name

# LF's logged metric names (get_batch_loss_metrics), in its order; eval prefixes them with "eval_".
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")
_FIELDS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True)
class DPOArgs(TrainArgs):
    """TrainArgs plus LF's FinetuningArguments for preference training (their defaults)."""

    pref_beta: float = 0.1
    pref_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    pref_ftx: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.pref_loss != "sigmoid":
            raise NotImplementedError(f"pref_loss {self.pref_loss!r}: only LF's default 'sigmoid' is implemented")


@dataclass(frozen=True)
class DPOResult:
    step_losses: list[float]
    step_metrics: dict[str, list[float]]  # METRICS name -> one value per optimizer step
    eval_before: dict[str, float]  # "loss" and every METRICS name
    eval_after: dict[str, float]
    lora_state_dict: dict[str, np.ndarray]
    wall_clock_s: float


def load_pairwise_dataset(tokenizer_dir, data_dir, split: str, args: DPOArgs) -> list[dict]:
    """data_dir/{split}.json (alpaca preference rows, with an `images` column for a vision-language template)
    through the template and the pairwise processor."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    rows = json.loads((Path(data_dir) / f"{split}.json").read_text())
    return preprocess_pairwise_dataset(rows, tokenizer, template, args.cutoff_len, media_dir(args, data_dir))


def make_collator(args: DPOArgs, tokenizer_dir=None, pad_to_length: int | None = None, data_dir=None,
                  rope_index=None) -> PairwiseDataCollator:
    """The pairwise collator; pad id = the template-fixed tokenizer's pad, 0 without a tokenizer. A
    vision-language template's also reads the rows' images (from data_dir, or args.media_dir) and takes the
    model's rope_index."""
    if tokenizer_dir is None:
        return PairwiseDataCollator(pad_token_id=0, pad_to_length=pad_to_length)
    return PairwiseDataCollator(pad_token_id=_fixed_tokenizer(tokenizer_dir, args)[1].pad_token_id,
                                pad_to_length=pad_to_length,
                                mm=multimodal_context(args, tokenizer_dir, data_dir, rope_index))


# ---- the loss (pure jnp) ---------------------------------------------------------------------

def get_batch_logps(logits, labels):
    """f32[B,T,V], i32[B,T] -> (log-probs summed over labelled tokens f32[B], valid lengths i32[B])."""
    labels = labels[:, 1:]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    mask = labels != IGNORE_INDEX
    # one-hot of the dummy id 0 on ignored positions, zeroed by the mask (a dense multiply, not a scatter)
    token_logps = jnp.sum(logp * jax.nn.one_hot(jnp.where(mask, labels, 0), logp.shape[-1], dtype=logp.dtype), -1)
    return jnp.sum(token_logps * mask, axis=-1), jnp.sum(mask, axis=-1)


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             label_smoothing: float = 0.0):
    """TRL's sigmoid DPO loss: (per-pair losses, chosen rewards, rejected rewards), each f32[N]."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    logits = chosen_logratios - rejected_logratios
    losses = (-jax.nn.log_sigmoid(beta * logits) * (1 - label_smoothing)
              - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
    return (losses, jax.lax.stop_gradient(beta * chosen_logratios),
            jax.lax.stop_gradient(beta * rejected_logratios))


def concatenated_forward(module, variables: dict, batch: dict) -> dict:
    """One forward of the 2N collated rows (chosen first) -> chosen/rejected log-probs f32[N], logits
    f32[N,T,V], and the chosen log-probs per valid token. The SFT twin's forward (sft._forward): a Qwen-VL batch
    brings its M-RoPE positions and the tower's image features, a fixed-size tower's its image features (and Gemma
    3's and PaliGemma's token types), a text batch takes torch's collated positions (its longrope table)."""
    logits = _forward(module, variables, batch)
    logits = logits.astype(jnp.float32)
    logps, valid = get_batch_logps(logits, batch["labels"])
    n = logits.shape[0] // 2
    return {"chosen_logps": logps[:n], "rejected_logps": logps[n:], "chosen_logits": logits[:n],
            "rejected_logits": logits[n:], "chosen_logps_avg": logps[:n] / valid[:n]}


def reference_log_probs(module, variables: dict, batch: dict):
    """The reference policy's (chosen, rejected) log-probs: the same model with its adapter disabled."""
    out = concatenated_forward(module, disable_adapter(variables), batch)
    return jax.lax.stop_gradient(out["chosen_logps"]), jax.lax.stop_gradient(out["rejected_logps"])


def batch_loss_metrics(module, variables: dict, batch: dict, args: DPOArgs):
    """(mean loss over the batch's pairs, METRICS) of one collated batch [2N, T], chosen rows first. A
    static-shape batch padded with filler pairs also carries `pair_mask` f32[N] (1 = a real pair; chosen
    row i pairs with rejected row N + i) and `columns` (the length torch's collator gave the real rows)."""
    num_pairs, length = batch["input_ids"].shape[0] // 2, batch["input_ids"].shape[1]
    pair_mask, columns = batch.get("pair_mask", jnp.ones((num_pairs,), jnp.float32)), batch.get("columns", length)
    out = concatenated_forward(module, variables, batch)
    ref_chosen, ref_rejected = reference_log_probs(module, variables, batch)
    losses, chosen_rewards, rejected_rewards = dpo_loss(out["chosen_logps"], out["rejected_logps"], ref_chosen,
                                                        ref_rejected, args.pref_beta, args.dpo_label_smoothing)
    if args.pref_ftx > 1e-6:
        valid = jnp.sum(batch["labels"][: pair_mask.shape[0], 1:] != IGNORE_INDEX, axis=-1)
        losses = losses - args.pref_ftx * out["chosen_logps"] / jnp.where(pair_mask > 0, valid, 1)
    n = jnp.maximum(jnp.sum(pair_mask), 1.0)  # a filler micro-batch has no pair: its means are 0, not NaN

    def mean(x):
        return jnp.sum(x * pair_mask) / n

    def logits_mean(logits):  # over the real rows and the first `columns` positions, every vocab entry
        col = (jnp.arange(logits.shape[1]) < columns).astype(jnp.float32)
        total = jnp.einsum("btv,b,t->", logits, pair_mask, col)
        return total / (n * columns * logits.shape[2])

    values = (mean(chosen_rewards), mean(rejected_rewards),
              mean((chosen_rewards > rejected_rewards).astype(jnp.float32)), mean(chosen_rewards - rejected_rewards),
              mean(out["chosen_logps"]), mean(out["rejected_logps"]),
              logits_mean(out["chosen_logits"]), logits_mean(out["rejected_logits"]))
    return mean(losses), dict(zip(METRICS, (jax.lax.stop_gradient(v) for v in values)))


# ---- jitted steps (cached per module, optimizer and args) ------------------------------------

def _accumulate(module, args, params, lora, batches):
    """batches: i32[GA,2B,L] fields, pair_mask f32[GA,B], micro_mask f32[GA], columns i32[GA] ->
    (step loss, step metrics, summed grads); each micro loss / the real micro-batch count."""
    num_micro = jnp.sum(batches["micro_mask"])

    def micro_loss(lora, mb):
        loss, metrics = batch_loss_metrics(module, {"params": params, "lora": lora}, mb, args)
        return loss * mb["micro_mask"] / num_micro, metrics

    def body(carry, mb):
        loss_sum, metric_sum, grad_sum = carry
        (loss, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(lora, mb)
        metric_sum = {k: metric_sum[k] + jnp.where(mb["micro_mask"] > 0, v, 0.0) / num_micro
                      for k, v in metrics.items()}
        return (loss_sum + loss, metric_sum, jax.tree.map(jnp.add, grad_sum, grads)), None

    zeros = {k: jnp.zeros((), jnp.float32) for k in METRICS}
    init = (jnp.zeros((), jnp.float32), zeros, jax.tree.map(jnp.zeros_like, lora))
    (loss, metrics, grads), _ = jax.lax.scan(body, init, batches)
    return loss, metrics, grads


@functools.lru_cache(maxsize=None)
def _loss_and_grads_fn(module, args):
    return jax.jit(functools.partial(_accumulate, module, args))


@functools.lru_cache(maxsize=None)
def _train_step_fn(module, args, tx):
    def train_step(params, lora, opt_state, batches):
        loss, metrics, grads = _accumulate(module, args, params, lora, batches)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return jax.tree.map(jnp.add, lora, updates), opt_state, loss, metrics

    return jax.jit(train_step, donate_argnums=(1, 2))


@functools.lru_cache(maxsize=None)
def _eval_fn(module, args):
    def batch_metrics(params, lora, batch):
        return batch_loss_metrics(module, {"params": params, "lora": lora}, batch, args)

    return jax.jit(batch_metrics)


# ---- static-shape batching -------------------------------------------------------------------

def _pad_pairs(batch: dict, pairs: int, length: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """A collated [2n, t] batch -> [2*pairs, length]: chosen rows at 0..n-1, rejected at pairs..pairs+n-1.
    Filler rows have a full attention mask (no empty softmax row) and no labels."""
    n2, t = np.shape(batch["input_ids"])
    n = n2 // 2
    out = {"input_ids": np.full((2 * pairs, length), pad_token_id, np.int32),
           "attention_mask": np.ones((2 * pairs, length), np.int32),
           "labels": np.full((2 * pairs, length), IGNORE_INDEX, np.int32)}
    for half in (0, 1):
        rows = slice(half * pairs, half * pairs + n)
        out["attention_mask"][rows] = 0
        for k in _FIELDS:
            out[k][rows, :t] = np.asarray(batch[k])[half * n:(half + 1) * n]
    if "position_ids" in batch:  # M-RoPE positions follow their rows (pads at 0)
        out["position_ids"] = np.zeros((3, 2 * pairs, length), np.int32)
        for half in (0, 1):
            out["position_ids"][:, half * pairs:half * pairs + n, :t] = np.asarray(batch["position_ids"])[
                :, half * n:(half + 1) * n]
    if "token_type_ids" in batch:  # Gemma 3's and PaliGemma's token types follow their rows (pads and fillers 0)
        out["token_type_ids"] = np.zeros((2 * pairs, length), np.int32)
        for half in (0, 1):
            out["token_type_ids"][half * pairs:half * pairs + n, :t] = np.asarray(batch["token_type_ids"])[
                half * n:(half + 1) * n]
    # image features keep their reading order: filler rows between the halves hold no image token
    out.update({k: _pad_rows(v, 2 * pairs * length) for k, v in _tower_features(batch).items()})
    out["pair_mask"] = (np.arange(pairs) < n).astype(np.float32)
    out["columns"] = np.int32(max(t, 1))
    return out


def _empty_like(batch: dict) -> dict[str, np.ndarray]:
    """A micro-batch with no pair and batch's keys (a short last step's missing micro-batches)."""
    empty = {k: np.zeros((0, 0), np.int32) for k in _FIELDS}
    if "position_ids" in batch:
        empty["position_ids"] = np.zeros((3, 0, 0), np.int32)
    if "token_type_ids" in batch:
        empty["token_type_ids"] = np.zeros((0, 0), np.int32)
    return {**empty, **{k: np.zeros((0, *np.shape(v)[1:]), np.float32) for k, v in _tower_features(batch).items()}}


def _stack_step(micro_batches: list[dict], num_micro: int, pairs: int, length: int,
                pad_token_id: int) -> dict[str, np.ndarray]:
    """GA collated micro-batches -> stacked padded arrays [num_micro, ...]; missing micro-batches are filler."""
    empty = _empty_like(micro_batches[0])
    padded = [_pad_pairs(b, pairs, length, pad_token_id) for b in micro_batches]
    padded += [_pad_pairs(empty, pairs, length, pad_token_id)] * (num_micro - len(micro_batches))
    out = {k: np.stack([b[k] for b in padded]) for k in padded[0]}
    out["micro_mask"] = (np.arange(num_micro) < len(micro_batches)).astype(np.float32)
    return out


def _step_shape(step_batches: list[list[dict]]) -> tuple[int, int, int]:
    num_micro = max(len(s) for s in step_batches)
    pairs = max(np.shape(b["input_ids"])[0] // 2 for s in step_batches for b in s)
    length = max(np.shape(b["input_ids"])[1] for s in step_batches for b in s)
    return num_micro, pairs, length


def _host(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def dpo_step_loss_metrics_and_grads(model: CausalLM, lora_state_dict: dict, micro_batches: list[dict],
                                    args: DPOArgs) -> tuple[float, dict[str, float], dict]:
    """Loss, metrics and LoRA grads ({peft name: array}, torch layout) of one accumulation step, no update."""
    batches = _stack_step([_embedded(model, b) for b in micro_batches], *_step_shape([micro_batches]), pad_token_id=0)
    loss, metrics, grads = _loss_and_grads_fn(model.module, args)(
        model.params, lora_tree_from_state_dict(lora_state_dict), batches)
    return float(loss), _host(metrics), _peft_state_dict(grads)


def _run_steps(model: CausalLM, lora, tx, steps, args: DPOArgs, pad_token_id: int, shape):
    """The jitted step over an iterable of micro-batch lists -> (losses, per-step metrics, final lora)."""
    step_fn = _train_step_fn(model.module, args, tx)
    opt_state = tx.init(lora)
    losses, metrics = [], []
    for micro_batches in steps:
        batches = _stack_step([_embedded(model, b) for b in micro_batches], *shape, pad_token_id)
        lora, opt_state, loss, m = step_fn(model.params, lora, opt_state, batches)
        losses.append(loss)  # stays on device: no host sync per step
        metrics.append(m)
    metrics = jax.device_get(metrics)
    return ([float(x) for x in jax.device_get(losses)], {k: [float(m[k]) for m in metrics] for k in METRICS}, lora)


def train_steps(model_dir, lora_init_state_dict: dict, step_batches: list[list[dict]],
                args: DPOArgs) -> tuple[list[float], dict]:
    """len(step_batches) optimizer steps on fixed collated pairwise batches (the schedule spans them all)."""
    model = load_model(model_dir, lora_config(args))
    tx = _lora_optimizer(args, len(step_batches))
    losses, _, lora = _run_steps(model, lora_tree_from_state_dict(lora_init_state_dict), tx, step_batches, args, 0,
                                 _step_shape(step_batches))
    return losses, lora_state_dict(lora)


def _evaluate(model: CausalLM, lora, features: list[dict], args: DPOArgs, length: int,
              pad_token_id: int, mm=None) -> dict[str, float]:
    """Per eval batch (in order) the loss and METRICS, each then averaged over batches; every batch is
    padded to [2 x eval batch size, length] (one compile) with the training collator's pad id (the
    logits/* means see the pads); `mm`: a vision-language task's collator context."""
    collate, size = PairwiseDataCollator(pad_token_id=pad_token_id, mm=mm), args.per_device_eval_batch_size
    fn = _eval_fn(model.module, args)
    results = [fn(model.params, lora, _pad_pairs(_embedded(model, collate(features[s:s + size])), size, length,
                                                 pad_token_id))
               for s in range(0, len(features), size)]
    results = jax.device_get(results)
    return {"loss": float(np.mean([loss for loss, _ in results])),
            **{k: float(np.mean([m[k] for _, m in results])) for k in METRICS}}


def _bucket_length(features: list[dict], extra: int = 0) -> int:
    """The longest chosen or rejected row plus `extra` (LF's fake image on an image-free vision-language batch's
    first chosen row), rounded up to a multiple of 8."""
    longest = max(len(f[f"{key}_input_ids"]) for f in features for key in ("chosen", "rejected"))
    return -(-(longest + extra) // 8) * 8


def train_dpo(model_dir, tokenizer_dir, data_dir, args: DPOArgs = DPOArgs()) -> DPOResult:
    """End to end from data_dir/{train,eval}.json (alpaca preference rows) to a trained adapter."""
    start = time.perf_counter()
    train = load_pairwise_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_pairwise_dataset(tokenizer_dir, data_dir, "eval", args)
    model = load_model(model_dir, lora_config(args))
    # M-RoPE models: LF's collator asks the model for positions
    collate = make_collator(args, tokenizer_dir, data_dir=data_dir, rope_index=getattr(model.module, "rope_index", None))
    length = _bucket_length(train + held_out, _fake_media_length(collate.mm))  # one static shape for every batch
    lora = init_lora_tree(model.params, lora_config(args), args.seed)  # lora_B = 0: the policy is the reference
    eval_before = _evaluate(model, lora, held_out, args, length, collate.pad_token_id, collate.mm)
    tx = _lora_optimizer(args, num_training_steps(len(train), args))
    steps = ([collate([train[i] for i in idx]) for idx in step]
             for epoch in range(args.num_train_epochs)
             for step in step_example_indices(len(train), args, epoch))
    shape = (args.gradient_accumulation_steps, args.per_device_train_batch_size, length)
    step_losses, step_metrics, lora = _run_steps(model, lora, tx, steps, args, collate.pad_token_id, shape)
    eval_after = _evaluate(model, lora, held_out, args, length, collate.pad_token_id, collate.mm)
    return DPOResult(step_losses, step_metrics, eval_before, eval_after, lora_state_dict(lora),
                     time.perf_counter() - start)
