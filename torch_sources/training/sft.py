"""LoRA SFT of Llama 3 the way LLaMA-Factory runs it (stage sft, finetuning_type lora), in eager PyTorch.

raw alpaca json -> llama3 template -> supervised processor (cutoff_len) -> collator (right
padding, multiple of 8) -> frozen base + LoRA on every projection -> HF Trainer loop:
gradient accumulation over GA micro-batches, each micro-batch loss = summed CE / labelled
positions of the whole accumulation step (loss.py: HF's num_items_in_batch; the step loss is the
token mean unless train_on_prompt labels the first position; a vision-language model, whose processor LF loads:
each micro-batch's own token mean / the step's micro-batch count, `loads_processor`), grads summed,
clipped to max_grad_norm, AdamW step, scheduler step (`lr_scheduler_type`: HF's linear or
LLaMA-Factory's cosine). eval_loss is HF Trainer.evaluate's: each eval batch's loss is the token
mean of that batch alone, and eval_loss is the mean over batches (not over all eval tokens).

Data order is framework-independent: epoch e visits the train set in
np.random.default_rng(seed + e).permutation order, B rows per micro-batch, GA micro-batches
per optimizer step (the epoch's last step may hold fewer, as in HF).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torch_sources.models import auto

from .collator import MultimodalContext, SFTDataCollator
from .lora import PEFT_PREFIX, LoraConfig, inject_lora, load_lora_state_dict, lora_state_dict
from .loss import causal_lm_loss, count_label_tokens
from .optimizer import LR_MULTIPLIERS, clip_grad_norm, create_optimizer
from .processor import preprocess_supervised_dataset
from .template import get_template, load_tokenizer

__all__ = ["TrainArgs", "SFTResult", "lora_config", "media_dir", "load_processed_dataset", "multimodal_context",
           "make_collator", "MODEL_INPUTS", "model_inputs", "loads_processor", "step_example_indices",
           "num_training_steps", "load_model", "sft_step_loss_and_grads", "train_steps", "mean_of_batch_losses",
           "evaluate_loss", "train_sft"]


@dataclass(frozen=True)
class TrainArgs:
    """HF TrainingArguments / LF data and finetuning argument names."""

    learning_rate: float = 5e-3  # LF's 1e-4 is for real models; the tiny one needs a bigger step
    num_train_epochs: int = 3
    per_device_train_batch_size: int = 4
    per_device_eval_batch_size: int = 4
    gradient_accumulation_steps: int = 2
    lr_scheduler_type: str = "cosine"  # LLaMA-Factory's example configs; HF's own default is "linear"
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    cutoff_len: int = 64
    template: str = "llama3"
    seed: int = 0
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    train_on_prompt: bool = False  # LF: label the prompts too
    mask_history: bool = False  # LF: label the last turn only, and give it the cutoff budget first
    media_dir: str | None = None  # LF's DataArguments.media_dir: where the rows' images are (None: the dataset dir)

    def __post_init__(self):
        if self.lr_scheduler_type not in LR_MULTIPLIERS:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of {sorted(LR_MULTIPLIERS)}")


@dataclass(frozen=True)
class SFTResult:
    step_losses: list[float]
    eval_loss_before: float
    eval_loss_after: float
    lora_state_dict: dict[str, np.ndarray]
    wall_clock_s: float


def lora_config(args: TrainArgs) -> LoraConfig:
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)


def _fixed_tokenizer(tokenizer_dir, args: TrainArgs):
    """LF's load_tokenizer + get_template_and_fix_tokenizer: the template (a tower plugin bound to the processor
    files beside the tokenizer, as LF loads the processor from the model dir) and the fixed tokenizer."""
    template = get_template(args.template).bind(tokenizer_dir)
    return template, template.fix_special_tokens(load_tokenizer(tokenizer_dir))


def media_dir(args, data_dir) -> Path:
    """LF's media_dir: the rows' image paths are relative to it (its default: the dataset dir)."""
    return Path(args.media_dir) if args.media_dir is not None else Path(data_dir)


def load_processed_dataset(tokenizer_dir, data_dir, split: str, args: TrainArgs) -> list[dict]:
    """data_dir/{split}.json (alpaca rows, with an `images` column for a vision-language template) through the
    template (its mm plugin expands the image placeholders) and the supervised processor."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    rows = json.loads((Path(data_dir) / f"{split}.json").read_text())
    return preprocess_supervised_dataset(rows, tokenizer, template, args.cutoff_len, args.train_on_prompt,
                                         args.mask_history, media_dir(args, data_dir))


def multimodal_context(args, tokenizer_dir, data_dir, rope_index) -> MultimodalContext | None:
    """LF's MultiModalDataCollatorForSeq2Seq inputs for a template with an mm plugin (None otherwise): the plugin,
    the tokenizer (the fake image's tokens), the media dir and the model's rope index (its position ids)."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    if template.mm_plugin is None:
        return None
    return MultimodalContext(template.mm_plugin, tokenizer, media_dir(args, data_dir), rope_index)


def make_collator(args: TrainArgs, tokenizer_dir=None, pad_to_length: int | None = None, data_dir=None,
                  rope_index=None) -> SFTDataCollator:
    """The training collator; pad id = the template-fixed tokenizer's pad (LF: eos), 0 without a
    tokenizer (pads are masked and unlabelled, so the id never changes a loss). A vision-language template's
    also reads the rows' images (from data_dir, or args.media_dir) and takes the model's rope_index."""
    if tokenizer_dir is None:
        return SFTDataCollator(pad_token_id=0, pad_to_length=pad_to_length)
    mm = multimodal_context(args, tokenizer_dir, data_dir, rope_index)
    return SFTDataCollator(pad_token_id=_fixed_tokenizer(tokenizer_dir, args)[1].pad_token_id,
                           pad_to_length=pad_to_length, mm=mm)


def step_example_indices(num_examples: int, args: TrainArgs, epoch: int) -> list[list[np.ndarray]]:
    """Example indices of every micro-batch of every optimizer step of one epoch."""
    order = np.random.default_rng(args.seed + epoch).permutation(num_examples)
    B, GA = args.per_device_train_batch_size, args.gradient_accumulation_steps
    micro = [order[s:s + B] for s in range(0, num_examples, B)]
    return [micro[s:s + GA] for s in range(0, len(micro), GA)]


def num_training_steps(num_examples: int, args: TrainArgs) -> int:
    micro = math.ceil(num_examples / args.per_device_train_batch_size)
    return args.num_train_epochs * math.ceil(micro / args.gradient_accumulation_steps)


def load_model(model_dir, lora: LoraConfig | None = None, seed: int = 0):
    """The checkpoint's causal LM (its family from config.json) in eval mode (no dropout), with LoRA
    injected (base frozen) when configured."""
    model = auto.from_pretrained(model_dir).eval()
    if lora is not None:
        inject_lora(model, lora, seed)
    return model


def _batch_tensors(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.as_tensor(np.asarray(batch[k]), dtype=torch.long)
                 for k in ("input_ids", "attention_mask", "labels"))


MODEL_INPUTS = {"position_ids": torch.long, "pixel_values": torch.float32, "image_grid_thw": torch.long,
                "input_features": torch.float32, "feature_attention_mask": torch.long,
                "token_type_ids": torch.long, "image_sizes": torch.long}  # the last two: the towers' plugins


def model_inputs(batch: dict) -> dict[str, torch.Tensor]:
    """What a vision-language collator adds for the forward (M-RoPE positions, pixels, grids, Omni's audio
    features with their frame mask, Gemma's token types, LLaVA-NeXT's image sizes); {} for text."""
    return {k: torch.as_tensor(np.asarray(batch[k]), dtype=dtype) for k, dtype in MODEL_INPUTS.items() if k in batch}


def loads_processor(batch: dict) -> bool:
    """Whether LF's SFT trainer runs this batch with a processor loaded: a vision-language model's collator gives
    every batch pixel values (its fake image when no row has one). LF 0.9.5's CustomSeq2SeqTrainer then sets
    model_accepts_loss_kwargs = False, so the step's num_items_in_batch never reaches the loss."""
    return "pixel_values" in batch


def _accumulate_grads(model, micro_batches: list[dict]) -> float:
    """Forward + backward of each micro-batch into .grad; returns the step loss. Text: each micro-batch's summed CE
    over the whole step's labelled positions (the step's token mean). With a processor (loads_processor): each
    micro-batch's own token mean over its shifted labels, divided by the step's micro-batch count (HF's
    current_gradient_accumulation_steps), as LF trains a vision-language model."""
    per_micro = loads_processor(micro_batches[0])
    num_items = None if per_micro else sum(count_label_tokens(b["labels"]) for b in micro_batches)
    total = 0.0
    for batch in micro_batches:
        input_ids, attention_mask, labels = _batch_tensors(batch)
        loss = causal_lm_loss(model(input_ids, attention_mask, **model_inputs(batch)), labels, num_items)
        if per_micro:
            loss = loss / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total


def _lora_grads(model) -> dict[str, np.ndarray]:
    return {PEFT_PREFIX + n: p.grad.detach().cpu().numpy().copy()
            for n, p in model.named_parameters() if ".lora_" in n}


def sft_step_loss_and_grads(model, lora_state_dict: dict, micro_batches: list[dict]) -> tuple[float, dict]:
    """Loss and LoRA grads ({peft name: array}, torch layout) of one accumulation step, no update.

    model: load_model(dir, lora_config(args)); its adapters are set to lora_state_dict first.
    """
    load_lora_state_dict(model, lora_state_dict)
    model.zero_grad(set_to_none=True)
    loss = _accumulate_grads(model, micro_batches)
    grads = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    return loss, grads


def _train_step(model, optimizer, scheduler, micro_batches: list[dict], max_grad_norm: float) -> float:
    loss = _accumulate_grads(model, micro_batches)
    if max_grad_norm > 0:
        clip_grad_norm((p for p in model.parameters() if p.requires_grad), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train_steps(model_dir, lora_init_state_dict: dict, step_batches: list[list[dict]],
                args: TrainArgs) -> tuple[list[float], dict]:
    """len(step_batches) optimizer steps on fixed collated batches (the schedule spans them all)."""
    model = load_model(model_dir, lora_config(args), args.seed)
    load_lora_state_dict(model, lora_init_state_dict)
    optimizer, scheduler = create_optimizer(model.named_parameters(), args, len(step_batches))
    losses = [_train_step(model, optimizer, scheduler, batches, args.max_grad_norm) for batches in step_batches]
    return losses, lora_state_dict(model)


def mean_of_batch_losses(batch_losses: list[float]) -> float:
    """HF Trainer.evaluation_loop's eval_loss from per-batch losses.

    Each batch's loss is repeated eval_batch_size times (a short last batch too: the configured
    size, not the observed one), so every batch weighs the same; non-finite losses are dropped
    first (logging_nan_inf_filter, on by default) unless all are.
    """
    losses = np.asarray(batch_losses, np.float64)
    finite = np.isfinite(losses)
    return float(losses[finite].mean() if finite.any() else losses.mean())


@torch.no_grad()
def _evaluate(model, features: list[dict], batch_size: int, collate=None) -> float:
    """HF prediction_step per batch of features (in order): compute_loss with num_items_in_batch =
    this batch's labelled positions (loss.count_label_tokens), i.e. the batch's token mean unless the first
    position is labelled (train_on_prompt); with a processor (loads_processor) none reaches the loss, which is the
    model's own mean over the shifted labels; then mean_of_batch_losses. `collate`: a vision-language task's
    collator; text rows are padded with 0 (pads are masked and unlabelled: their id is irrelevant)."""
    collate = collate or SFTDataCollator(pad_token_id=0)
    losses = []
    for s in range(0, len(features), batch_size):
        batch = collate(features[s:s + batch_size])
        input_ids, attention_mask, labels = _batch_tensors(batch)
        logits = model(input_ids, attention_mask, **model_inputs(batch))
        num_items = None if loads_processor(batch) else count_label_tokens(labels)
        losses.append(causal_lm_loss(logits, labels, num_items).item())
    return mean_of_batch_losses(losses)


def evaluate_loss(model_dir, lora_state_dict: dict | None, eval_features: list[dict], args: TrainArgs,
                  tokenizer_dir=None, data_dir=None) -> float:
    """HF eval_loss over eval_features (processed rows) in batches of per_device_eval_batch_size:
    the mean of each batch's token-mean CE. The base model when lora_state_dict is None. A vision-language
    task's rows need its tokenizer_dir and data_dir (their images; LF's fake image for an image-free batch)."""
    model = load_model(model_dir, lora_config(args) if lora_state_dict is not None else None, args.seed)
    if lora_state_dict is not None:
        load_lora_state_dict(model, lora_state_dict)
    mm = None if tokenizer_dir is None else multimodal_context(args, tokenizer_dir, data_dir,
                                                               getattr(model, "rope_index", None))
    return _evaluate(model, eval_features, args.per_device_eval_batch_size,
                     None if mm is None else SFTDataCollator(pad_token_id=0, mm=mm))


def train_sft(model_dir, tokenizer_dir, data_dir, args: TrainArgs = TrainArgs()) -> SFTResult:
    """End to end from data_dir/{train,eval}.json (alpaca rows) to a trained adapter."""
    start = time.perf_counter()
    train = load_processed_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_processed_dataset(tokenizer_dir, data_dir, "eval", args)
    model = load_model(model_dir)
    rope_index = getattr(model, "rope_index", None)  # M-RoPE models: LF's collator asks the model for positions
    collate = make_collator(args, tokenizer_dir, data_dir=data_dir, rope_index=rope_index)
    mm = collate.mm
    eval_collate = None if mm is None else SFTDataCollator(pad_token_id=0, mm=mm)
    eval_loss_before = _evaluate(model, held_out, args.per_device_eval_batch_size, eval_collate)
    inject_lora(model, lora_config(args), args.seed)
    optimizer, scheduler = create_optimizer(model.named_parameters(), args, num_training_steps(len(train), args))
    model.train()
    step_losses = []
    for epoch in range(args.num_train_epochs):
        for step in step_example_indices(len(train), args, epoch):
            batches = [collate([train[i] for i in idx]) for idx in step]
            step_losses.append(_train_step(model, optimizer, scheduler, batches, args.max_grad_norm))
    model.eval()
    eval_loss_after = _evaluate(model, held_out, args.per_device_eval_batch_size, eval_collate)
    return SFTResult(step_losses, eval_loss_before, eval_loss_after, lora_state_dict(model),
                     time.perf_counter() - start)
