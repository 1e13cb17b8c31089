"""LoRA DPO of Llama 3 the way LLaMA-Factory runs it (stage dpo, finetuning_type lora), in eager PyTorch.

raw alpaca preference json (instruction, input, chosen, rejected) -> llama3 template -> pairwise
processor (cutoff_len, both responses cut alike) -> pairwise collator (all chosen rows, then all
rejected) -> LF's CustomDPOTrainer on HF Trainer:

- one forward of the 2N rows; per-sequence log-probs *summed* over response tokens
  (`get_batch_logps`: logits[:, :-1] against labels[:, 1:], labels != -100);
- the reference policy is the same model with its adapter disabled (LoRA with no ref_model:
  `disable_adapter()`, under no_grad);
- TRL's sigmoid loss -(1-eps) log sigma(beta h) - eps log sigma(-beta h), h = the policy's
  chosen-minus-rejected log ratio minus the reference's, plus pref_ftx times the chosen
  tokens' mean NLL; the micro-batch loss is the mean over its pairs;
- HF Trainer with `model_accepts_loss_kwargs = False` (LF sets it): each micro-batch loss is
  divided by the step's number of micro-batches, grads summed, clipped, AdamW, schedule;
- metrics per micro-batch (rewards = beta (logp - ref logp), accuracies, margins, log-probs and
  the mean of the raw logits), averaged over the batches stored before a log, as LF's `log` does.

Data order, optimizer and schedule are the SFT workflow's (sft.py), so a DPO step differs from an
SFT step only in its loss. Evaluation is HF Trainer.evaluate on the held-out pairs: each metric is
the mean over eval batches of that batch's value.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .collator import PairwiseDataCollator
from .loss import IGNORE_INDEX
from .lora import disable_adapter, inject_lora, load_lora_state_dict, lora_state_dict
from .optimizer import clip_grad_norm, create_optimizer
from .processor import preprocess_pairwise_dataset
from .sft import (TrainArgs, _fixed_tokenizer, _lora_grads, load_model, lora_config, media_dir, model_inputs,
                  multimodal_context, num_training_steps,
                  step_example_indices)

__all__ = ["DPOArgs", "DPOResult", "METRICS", "load_pairwise_dataset", "make_collator", "get_batch_logps",
           "dpo_loss", "concatenated_forward", "reference_log_probs", "batch_loss_metrics",
           "dpo_step_loss_metrics_and_grads", "train_steps", "train_dpo"]

# LF's logged metric names (get_batch_loss_metrics), in its order; eval prefixes them with "eval_".
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


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
    """The pairwise collator; pad id = the template-fixed tokenizer's pad, 0 without a tokenizer
    (pads are masked and unlabelled, so the id never changes a log-prob). A vision-language template's also reads
    the rows' images (from data_dir, or args.media_dir) and takes the model's rope_index."""
    if tokenizer_dir is None:
        return PairwiseDataCollator(pad_token_id=0, pad_to_length=pad_to_length)
    return PairwiseDataCollator(pad_token_id=_fixed_tokenizer(tokenizer_dir, args)[1].pad_token_id,
                                pad_to_length=pad_to_length,
                                mm=multimodal_context(args, tokenizer_dir, data_dir, rope_index))


def get_batch_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LF trainer_utils.get_batch_logps: f32[B,T,V], i64[B,T] -> (summed log-probs f32[B], valid lengths i64[B])."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != IGNORE_INDEX
    labels[labels == IGNORE_INDEX] = 0  # dummy token; masked out below
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token_logps * loss_mask).sum(-1), loss_mask.sum(-1)


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL DPOTrainer.dpo_loss, loss_type sigmoid: (per-pair losses, chosen rewards, rejected rewards), each f32[N]."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    logits = chosen_logratios - rejected_logratios
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def concatenated_forward(model, batch: dict) -> dict[str, torch.Tensor]:
    """One forward of the 2N collated rows -> chosen/rejected log-probs f32[N], logits f32[N,T,V], and
    the chosen log-probs per valid token (the ftx term's NLL)."""
    logits = model(batch["input_ids"], batch["attention_mask"], **model_inputs(batch)).float()
    logps, valid_length = get_batch_logps(logits, batch["labels"])
    n = batch["input_ids"].shape[0] // 2
    chosen_logps, rejected_logps = logps.split(n, dim=0)
    chosen_logits, rejected_logits = logits.split(n, dim=0)
    return {"chosen_logps": chosen_logps, "rejected_logps": rejected_logps, "chosen_logits": chosen_logits,
            "rejected_logits": rejected_logits, "chosen_logps_avg": chosen_logps / valid_length[:n]}


@torch.no_grad()
def reference_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference policy's (chosen, rejected) log-probs: the same model with its adapter disabled."""
    with disable_adapter(model):
        out = concatenated_forward(model, batch)
    return out["chosen_logps"], out["rejected_logps"]


def batch_loss_metrics(model, batch: dict, args: DPOArgs) -> tuple[torch.Tensor, dict[str, float]]:
    """LF CustomDPOTrainer.get_batch_loss_metrics: (mean loss over the batch's pairs, METRICS)."""
    out = concatenated_forward(model, batch)
    ref_chosen, ref_rejected = reference_log_probs(model, batch)
    losses, chosen_rewards, rejected_rewards = dpo_loss(out["chosen_logps"], out["rejected_logps"], ref_chosen,
                                                        ref_rejected, args.pref_beta, args.dpo_label_smoothing)
    if args.pref_ftx > 1e-6:
        losses = losses + args.pref_ftx * -out["chosen_logps_avg"]
    values = (chosen_rewards.mean(), rejected_rewards.mean(), (chosen_rewards > rejected_rewards).float().mean(),
              (chosen_rewards - rejected_rewards).mean(), out["chosen_logps"].mean(), out["rejected_logps"].mean(),
              out["chosen_logits"].mean(), out["rejected_logits"].mean())
    return losses.mean(), {name: float(v.detach()) for name, v in zip(METRICS, values)}


def _batch_tensors(batch: dict) -> dict[str, torch.Tensor]:
    """ids, mask and labels as int64 tensors, and a vision-language batch's model inputs (sft.model_inputs)."""
    ids = {k: torch.as_tensor(np.asarray(batch[k]), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    return {**ids, **model_inputs(batch)}


def _mean_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    return {name: float(np.mean([m[name] for m in per_batch])) for name in METRICS}


def _accumulate_grads(model, micro_batches: list[dict], args: DPOArgs) -> tuple[float, dict[str, float]]:
    """Forward + backward of each micro-batch into .grad (loss / the step's micro-batch count, as HF
    Trainer divides a loss that takes no num_items_in_batch); -> (step loss, step metrics)."""
    total, metrics = 0.0, []
    for batch in micro_batches:
        loss, m = batch_loss_metrics(model, _batch_tensors(batch), args)
        loss = loss / len(micro_batches)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    return total, _mean_metrics(metrics)


def dpo_step_loss_metrics_and_grads(model, lora_state_dict: dict, micro_batches: list[dict],
                                    args: DPOArgs) -> tuple[float, dict[str, float], dict]:
    """Loss, metrics and LoRA grads ({peft name: array}, torch layout) of one accumulation step, no update.

    model: load_model(dir, lora_config(args)); its adapters are set to lora_state_dict first.
    """
    load_lora_state_dict(model, lora_state_dict)
    model.zero_grad(set_to_none=True)
    loss, metrics = _accumulate_grads(model, micro_batches, args)
    grads = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    return loss, metrics, grads


def _train_step(model, optimizer, scheduler, micro_batches: list[dict], args: DPOArgs) -> tuple[float, dict]:
    loss, metrics = _accumulate_grads(model, micro_batches, args)
    if args.max_grad_norm > 0:
        clip_grad_norm((p for p in model.parameters() if p.requires_grad), args.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, metrics


def train_steps(model_dir, lora_init_state_dict: dict, step_batches: list[list[dict]],
                args: DPOArgs) -> tuple[list[float], dict]:
    """len(step_batches) optimizer steps on fixed collated pairwise batches (the schedule spans them all)."""
    model = load_model(model_dir, lora_config(args), args.seed)
    load_lora_state_dict(model, lora_init_state_dict)
    optimizer, scheduler = create_optimizer(model.named_parameters(), args, len(step_batches))
    losses = [_train_step(model, optimizer, scheduler, batches, args)[0] for batches in step_batches]
    return losses, lora_state_dict(model)


@torch.no_grad()
def _evaluate(model, features: list[dict], args: DPOArgs, pad_token_id: int, mm=None) -> dict[str, float]:
    """HF Trainer.evaluate: per eval batch of per_device_eval_batch_size pairs (in order) the loss and
    METRICS; each is then the mean over batches (every batch weighs the same). The pad id is the
    training collator's: the logits/* means run over every position, pads included (issue 31); `mm`: a
    vision-language task's collator context (its images, LF's fake image)."""
    collate, size = PairwiseDataCollator(pad_token_id=pad_token_id, mm=mm), args.per_device_eval_batch_size
    losses, metrics = [], []
    for s in range(0, len(features), size):
        loss, m = batch_loss_metrics(model, _batch_tensors(collate(features[s:s + size])), args)
        losses.append(loss.item())
        metrics.append(m)
    return {"loss": float(np.mean(losses)), **_mean_metrics(metrics)}


def train_dpo(model_dir, tokenizer_dir, data_dir, args: DPOArgs = DPOArgs()) -> DPOResult:
    """End to end from data_dir/{train,eval}.json (alpaca preference rows) to a trained adapter."""
    start = time.perf_counter()
    train = load_pairwise_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_pairwise_dataset(tokenizer_dir, data_dir, "eval", args)
    model = load_model(model_dir)
    # M-RoPE models: LF's collator asks the model for positions
    collate = make_collator(args, tokenizer_dir, data_dir=data_dir, rope_index=getattr(model, "rope_index", None))
    inject_lora(model, lora_config(args), args.seed)  # lora_B = 0: the policy starts as the reference
    eval_before = _evaluate(model, held_out, args, collate.pad_token_id, collate.mm)
    optimizer, scheduler = create_optimizer(model.named_parameters(), args, num_training_steps(len(train), args))
    model.train()
    step_losses, step_metrics = [], {name: [] for name in METRICS}
    for epoch in range(args.num_train_epochs):
        for step in step_example_indices(len(train), args, epoch):
            batches = [collate([train[i] for i in idx]) for idx in step]
            loss, metrics = _train_step(model, optimizer, scheduler, batches, args)
            step_losses.append(loss)
            for name in METRICS:
                step_metrics[name].append(metrics[name])
    model.eval()
    eval_after = _evaluate(model, held_out, args, collate.pad_token_id, collate.mm)
    return DPOResult(step_losses, step_metrics, eval_before, eval_after, lora_state_dict(model),
                     time.perf_counter() - start)
