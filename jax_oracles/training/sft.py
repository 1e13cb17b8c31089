"""LoRA SFT of Llama 3 as LLaMA-Factory runs it, in JAX/optax: twin of torch_sources/training/sft.py.

Same data order (np.random.default_rng(seed + epoch).permutation), same accumulation rule
(micro-batch loss = summed CE / labelled tokens of the whole step, grads summed), same clip,
AdamW and `lr_scheduler_type` schedule, same HF eval_loss (mean over eval batches of each
batch's token mean). One jitted train step does the whole accumulation step: a
lax.scan over GA micro-batches of one static shape [B, L] (every batch is right-padded to a
fixed length L, so it compiles once), then the optax update; the LoRA tree and the optimizer
state are donated. Rows or micro-batches that pad a short last step carry no labels (and a
full attention mask, so no softmax row is empty): they add exactly zero to loss and grads.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_oracles.models import auto

from .collator import MultimodalContext, SFTDataCollator, collated_positions
from .lora import LoraConfig, init_lora_tree, lora_state_dict, lora_tree_from_state_dict
from .mm_plugin import fake_input_ids
from .loss import IGNORE_INDEX, causal_lm_loss
from .optimizer import LR_MULTIPLIERS, create_optimizer, decay_parameter_names
from .processor import preprocess_supervised_dataset
from .template import get_template, load_tokenizer

__all__ = ["TrainArgs", "SFTResult", "lora_config", "media_dir", "load_processed_dataset", "multimodal_context",
           "make_collator", "MODEL_INPUTS", "model_inputs", "loads_processor", "step_example_indices",
           "num_training_steps", "CausalLM", "load_model", "IMAGE_FEATURES", "AUDIO_FEATURES", "encode_images",
           "encode_audio", "sft_step_loss_and_grads", "train_steps",
           "mean_of_batch_losses", "evaluate_loss", "train_sft"]

_peft_state_dict = lora_state_dict  # for functions whose lora_state_dict argument shadows the name

jax.config.update("jax_default_matmul_precision", "highest")  # fp32 parity with torch (no TF32/bf16 passes)


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
        assert self.lora_dropout == 0.0, "dropout would need a shared noise source with torch"


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


MODEL_INPUTS = {"position_ids": np.int32, "pixel_values": np.float32, "image_grid_thw": np.int64,
                "input_features": np.float32, "feature_attention_mask": np.int32,
                "token_type_ids": np.int32, "image_sizes": np.int64}  # the last two: the towers' plugins


def model_inputs(batch: dict) -> dict[str, np.ndarray]:
    """What a vision-language collator adds for the forward (M-RoPE positions, pixels, grids, Omni's audio
    features with their frame mask, Gemma's token types, LLaVA-NeXT's image sizes: host data); {} for text."""
    return {k: np.asarray(batch[k], dtype) for k, dtype in MODEL_INPUTS.items() if k in batch}


def step_example_indices(num_examples: int, args: TrainArgs, epoch: int) -> list[list[np.ndarray]]:
    """Example indices of every micro-batch of every optimizer step of one epoch."""
    order = np.random.default_rng(args.seed + epoch).permutation(num_examples)
    B, GA = args.per_device_train_batch_size, args.gradient_accumulation_steps
    micro = [order[s:s + B] for s in range(0, num_examples, B)]
    return [micro[s:s + GA] for s in range(0, len(micro), GA)]


def num_training_steps(num_examples: int, args: TrainArgs) -> int:
    micro = math.ceil(num_examples / args.per_device_train_batch_size)
    return args.num_train_epochs * math.ceil(micro / args.gradient_accumulation_steps)


@dataclass(frozen=True)
class CausalLM:
    """A Linen module and its base params (the JAX counterpart of a loaded torch model)."""

    module: object  # the family's ForCausalLM (flax.linen.Module)
    params: dict


def load_model(model_dir, lora: LoraConfig | None = None, seed: int = 0) -> CausalLM:
    """The checkpoint's causal LM (its family from config.json) as (module, params); LoRA weights are
    passed separately as the "lora" collection."""
    del seed  # kept for the torch signature; adapters come from init_lora_tree / lora_tree_from_state_dict
    return CausalLM(*auto.from_pretrained(model_dir, (lora or LoraConfig()).scaling))


# ---- jitted pieces (cached per module, optimizer and shape) ----------------------------------

def _label_count(labels):  # i32[..., T] -> f32 scalar: labelled positions before the shift (HF's num_items)
    return jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)


def _forward(module, variables, batch):
    """The family's logits on a padded batch: a Qwen-VL batch brings its M-RoPE positions and the tower's image
    features (computed outside the step: the tower is frozen); a fixed-size tower's batch (image features, no
    positions) runs at the model's own positions (0..T-1, PaliGemma's 1..T, as LF's forward), with Gemma 3's and
    PaliGemma's token types; a text batch takes torch's collated positions (its longrope table)."""
    if "position_ids" in batch:
        return module.apply(variables, batch["input_ids"], batch["attention_mask"],
                            position_ids=batch["position_ids"], **_tower_features(batch))
    if _image_features(batch):
        return module.apply(variables, batch["input_ids"], batch["attention_mask"], **_token_types(batch),
                            **_tower_features(batch))
    return module.apply(variables, batch["input_ids"], batch["attention_mask"],
                        position_ids=collated_positions(batch["attention_mask"]))


def loads_processor(batch: dict) -> bool:
    """Whether LF's SFT trainer runs this (collated) batch with a processor loaded: a vision-language model's collator
    gives every batch pixel values (its fake image when no row has one). LF 0.9.5's CustomSeq2SeqTrainer then sets
    model_accepts_loss_kwargs = False, so the step's num_items_in_batch never reaches the loss."""
    return "pixel_values" in batch


def _accumulate(module, params, lora, batches):
    """batches: dict of i32[GA,B,L] (+ position_ids i32[GA,3,B,L], image features f32[GA,N,...]) -> (step loss,
    summed grads) over the GA micro-batches. Text: the step's labelled positions divide every micro-batch's summed
    CE. A vision-language step (`micro_real` f32[GA]: LF loads a processor, model_accepts_loss_kwargs False): each
    real micro-batch's own token mean over its shifted labels, divided by the step's real micro-batch count."""
    per_micro = "micro_real" in batches
    num_items = None if per_micro else _label_count(batches["labels"])
    count = jnp.sum(batches["micro_real"]) if per_micro else None

    def micro_loss(lora, batch):
        logits = _forward(module, {"params": params, "lora": lora}, batch)
        if not per_micro:
            return causal_lm_loss(logits, batch["labels"], num_items)
        # a filler's 0 shifted labels count as 1: its loss is 0 (its mask zeroes it anyway), never 0/0
        shifted = jnp.maximum(jnp.sum(batch["labels"][:, 1:] != IGNORE_INDEX), 1).astype(jnp.float32)
        return causal_lm_loss(logits, batch["labels"], shifted) * batch["micro_real"] / count

    def body(carry, batch):
        loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(micro_loss)(lora, batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, lora))
    (loss, grads), _ = jax.lax.scan(body, init, batches)
    return loss, grads


@functools.lru_cache(maxsize=None)
def _loss_and_grads_fn(module):
    return jax.jit(functools.partial(_accumulate, module))


@functools.lru_cache(maxsize=None)
def _train_step_fn(module, tx):
    def train_step(params, lora, opt_state, batches):
        loss, grads = _accumulate(module, params, lora, batches)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(1, 2))


@functools.lru_cache(maxsize=None)
def _eval_fn(module):
    def batch_loss(params, lora, batch):  # -> the batch's token-mean CE (HF: its own num_items_in_batch)
        variables = {"params": params} if lora is None else {"params": params, "lora": lora}
        # with a processor (image features: embedded from pixels, loads_processor) no num_items reaches the loss:
        # the mean over the shifted labels
        num_items = None if _image_features(batch) else _label_count(batch["labels"])
        return causal_lm_loss(_forward(module, variables, batch), batch["labels"], num_items)

    return jax.jit(batch_loss)


# ---- static-shape batching -------------------------------------------------------------------

# The forward keywords that carry the frozen tower's output, each indexed by image token (reading order) on axis 0:
# the merged patches that replace the image tokens' embeddings (every Qwen-VL family), and Qwen3-VL's DeepStack
# features f32[n,K,D], added after the first K decoder layers. A batch pads each of them alike.
IMAGE_FEATURES = ("image_embeds", "deepstack_embeds")


def _image_features(batch: dict) -> dict:
    """The batch's image features (the forward's keywords; {} for text)."""
    return {k: batch[k] for k in IMAGE_FEATURES if k in batch}


# Qwen2.5-Omni's audio tower output, indexed by audio token on axis 0 (reading order): the rows that replace the audio
# tokens' embeddings. Frozen like the vision tower, so computed outside the step and padded the same way.
AUDIO_FEATURES = ("audio_embeds",)


def _tower_features(batch: dict) -> dict:
    """Every frozen tower's output the batch carries (image features, audio rows): the forward's keywords."""
    return {k: batch[k] for k in IMAGE_FEATURES + AUDIO_FEATURES if k in batch}


def _token_types(batch: dict) -> dict:
    """Gemma 3's and PaliGemma's token_type_ids i32[B,T] (their masks' image blocks / prefix), as a keyword; {}
    for every other family."""
    return {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}


def _as_features(encoded) -> dict:
    """A family's encode_images output as forward keywords: its dict (Qwen3-VL), or the merged patches alone."""
    return dict(encoded) if isinstance(encoded, dict) else {"image_embeds": encoded}


@functools.lru_cache(maxsize=None)
def _encode_fn(module, grid: tuple[int, int, int]):
    return jax.jit(lambda params, pixels: _as_features(
        module.apply({"params": params}, pixels, np.array([grid]), method="encode_images")))


@functools.lru_cache(maxsize=None)
def _encode_tower_fn(module, image_size: tuple[int, int] | None):
    """A fixed-size tower's encode_images on one image (Gemma 3, PaliGemma; InternVL's tile), or on one LLaVA-NeXT
    image's tile stack at its (static) image size."""
    if image_size is None:
        return jax.jit(lambda params, pixels: module.apply({"params": params}, pixels, method="encode_images"))
    return jax.jit(lambda params, pixels: module.apply({"params": params}, pixels, np.array([image_size]),
                                                       method="encode_images"))


def encode_images(model: "CausalLM", pixel_values, image_grid_thw=None, image_sizes=None) -> dict[str, np.ndarray]:
    """The frozen tower's output as forward keywords, one image at a time (reused compiles across batches), in
    the batch's order. Qwen-VL: f32[P, C*T*ps*ps], i64[I,3] -> {image_embeds f32[n,D]} (and deepstack_embeds
    f32[n,K,D] for Qwen3-VL), a compile per image grid. A fixed-size tower (no grids): f32[N,C,S,S] images
    (InternVL's tiles) -> {image_embeds f32[n,D]}, one compile; LLaVA-NeXT's f32[I,tiles,C,S,S] with image_sizes
    i64[I,2], a compile per image size."""
    if image_grid_thw is None:
        sizes = ([None] * len(pixel_values) if image_sizes is None
                 else [tuple(size) for size in np.asarray(image_sizes).tolist()])
        out = [_encode_tower_fn(model.module, size)(model.params, np.asarray(pixel_values[i:i + 1], np.float32))
               for i, size in enumerate(sizes)]
        return {"image_embeds": np.concatenate([np.asarray(o) for o in jax.device_get(out)])}
    out, start = [], 0
    for grid in np.asarray(image_grid_thw).tolist():
        n = int(np.prod(grid))
        out.append(_encode_fn(model.module, tuple(grid))(model.params, pixel_values[start:start + n]))
        start += n
    out = jax.device_get(out)
    return {k: np.concatenate([np.asarray(o[k]) for o in out]) for k in out[0]}


@functools.lru_cache(maxsize=None)
def _encode_audio_fn(module, frames: tuple[int, ...], width: int):
    mask = (np.arange(width)[None] < np.array(frames)[:, None]).astype(np.int32)  # static: the host-side indices
    return jax.jit(lambda params, features: module.apply({"params": params}, features, mask, method="encode_audio"))


def encode_audio(model: "CausalLM", input_features, feature_attention_mask) -> np.ndarray:
    """f32[A, mel, F], [A, F] -> f32[m, output_dim]: the frozen audio tower's rows of a batch's audios, in reading
    order (a compile per set of audio lengths: LF's fake audio is always the same 10 frames)."""
    mask = np.asarray(feature_attention_mask)
    frames = mask.sum(-1)
    if not np.array_equal(mask, np.arange(mask.shape[1])[None] < frames[:, None]):
        raise ValueError("feature_attention_mask must cover each audio's leading frames (the Whisper extractor's)")
    fn = _encode_audio_fn(model.module, tuple(int(n) for n in frames), mask.shape[1])
    return np.asarray(fn(model.params, np.asarray(input_features, np.float32)))


def _embedded(model: "CausalLM", batch: dict) -> dict:
    """A collated vision-language batch with its media through the frozen towers (the image features, and Omni's
    audio_embeds, instead of pixel_values, grids or image sizes, input_features, the frame mask and rope deltas:
    what the jitted step takes; Gemma 3's and PaliGemma's token_type_ids stay); a text batch as it is."""
    if not loads_processor(batch):
        return batch
    media = ("pixel_values", "image_grid_thw", "image_sizes", "rope_deltas", "input_features", "feature_attention_mask")
    out = {**{k: v for k, v in batch.items() if k not in media},
           **encode_images(model, batch["pixel_values"], batch.get("image_grid_thw"), batch.get("image_sizes"))}
    if "input_features" in batch:
        out["audio_embeds"] = encode_audio(model, batch["input_features"], batch["feature_attention_mask"])
    return out


def _pad_rows(x, rows: int) -> np.ndarray:
    """f32[n, ...] -> f32[rows, ...]: zero rows after x's (image features: never read, no image token points
    there)."""
    x = np.asarray(x, np.float32)
    out = np.zeros((rows, *x.shape[1:]), np.float32)
    out[:len(x)] = x
    return out


def _pad_batch(batch: dict, rows: int, length: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """Right-pad a collated batch to [rows, length]. Pad columns of real rows are masked; filler
    rows get a full mask (no empty softmax row) and no labels. M-RoPE positions and token types pad with 0, image
    features (and audio rows) with zero rows up to rows * length (the most image or audio tokens the batch can
    hold)."""
    n, t = np.shape(batch["input_ids"])
    ids = np.full((rows, length), pad_token_id, np.int32)
    mask = np.ones((rows, length), np.int32)
    mask[:n] = 0
    labels = np.full((rows, length), IGNORE_INDEX, np.int32)
    ids[:n, :t], mask[:n, :t], labels[:n, :t] = batch["input_ids"], batch["attention_mask"], batch["labels"]
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if "position_ids" in batch:
        out["position_ids"] = np.zeros((3, rows, length), np.int32)
        out["position_ids"][:, :n, :t] = batch["position_ids"]
    if "token_type_ids" in batch:
        out["token_type_ids"] = np.zeros((rows, length), np.int32)
        out["token_type_ids"][:n, :t] = batch["token_type_ids"]
    return {**out, **{k: _pad_rows(v, rows * length) for k, v in _tower_features(batch).items()}}


def _filler(like: dict) -> dict[str, np.ndarray]:
    """An empty micro-batch with like's keys (a short last step's missing micro-batches)."""
    empty = {k: np.zeros((0, 0), np.int32) for k in ("input_ids", "attention_mask", "labels")}
    if "position_ids" in like:
        empty["position_ids"] = np.zeros((3, 0, 0), np.int32)
    if "token_type_ids" in like:
        empty["token_type_ids"] = np.zeros((0, 0), np.int32)
    return {**empty, **{k: np.zeros((0, *np.shape(v)[1:]), np.float32) for k, v in _tower_features(like).items()}}


def _stack_step(micro_batches: list[dict], num_micro: int, rows: int, length: int,
                pad_token_id: int) -> dict[str, np.ndarray]:
    """GA micro-batches -> dict of i32[num_micro, rows, length] (+ positions, embeddings); missing micro-batches
    are filler."""
    padded = [_pad_batch(b, rows, length, pad_token_id) for b in micro_batches]
    padded += [_pad_batch(_filler(micro_batches[0]), rows, length, pad_token_id)] * (num_micro - len(micro_batches))
    stacked = {k: np.stack([b[k] for b in padded]) for k in padded[0]}
    if _image_features(padded[0]):  # embedded from pixels (loads_processor): which micro-batches are real, the divisor
        stacked["micro_real"] = (np.arange(num_micro) < len(micro_batches)).astype(np.float32)
    return stacked


def _step_shape(step_batches: list[list[dict]]) -> tuple[int, int, int]:
    num_micro = max(len(s) for s in step_batches)
    rows = max(np.shape(b["input_ids"])[0] for s in step_batches for b in s)
    length = max(np.shape(b["input_ids"])[1] for s in step_batches for b in s)
    return num_micro, rows, length


def sft_step_loss_and_grads(model: CausalLM, lora_state_dict: dict, micro_batches: list[dict]) -> tuple[float, dict]:
    """Loss and LoRA grads ({peft name: array}, torch layout) of one accumulation step, no update."""
    num_micro, rows, length = _step_shape([micro_batches])
    batches = _stack_step([_embedded(model, b) for b in micro_batches], num_micro, rows, length, pad_token_id=0)
    loss, grads = _loss_and_grads_fn(model.module)(model.params, lora_tree_from_state_dict(lora_state_dict), batches)
    return float(loss), _peft_state_dict(grads)


@functools.lru_cache(maxsize=None)
def _lora_optimizer(args: TrainArgs, num_steps: int) -> optax.GradientTransformation:
    """create_optimizer on the raveled adapters (cached: the same run shape reuses its compile)."""
    return create_optimizer(args, num_steps, flatten=True)


def _run_steps(model: CausalLM, lora, tx, steps, pad_token_id: int, shape) -> tuple[list[float], dict]:
    """Run the jitted step over an iterable of micro-batch lists; returns (losses, final lora tree)."""
    if len(decay_parameter_names(lora)) != len(jax.tree.leaves(lora)):  # what flatten=True assumes
        raise ValueError("the flat optimizer needs every trainable leaf to take weight decay")
    step_fn = _train_step_fn(model.module, tx)
    opt_state = tx.init(lora)
    losses = []
    for micro_batches in steps:
        batches = _stack_step([_embedded(model, b) for b in micro_batches], *shape, pad_token_id)
        lora, opt_state, loss = step_fn(model.params, lora, opt_state, batches)
        losses.append(loss)  # stays on device: no host sync per step
    return [float(x) for x in jax.device_get(losses)], lora


def train_steps(model_dir, lora_init_state_dict: dict, step_batches: list[list[dict]],
                args: TrainArgs) -> tuple[list[float], dict]:
    """len(step_batches) optimizer steps on fixed collated batches (the schedule spans them all)."""
    model = load_model(model_dir, lora_config(args))
    lora = lora_tree_from_state_dict(lora_init_state_dict)
    tx = _lora_optimizer(args, len(step_batches))
    losses, lora = _run_steps(model, lora, tx, step_batches, 0, _step_shape(step_batches))
    return losses, lora_state_dict(lora)


def mean_of_batch_losses(batch_losses: list[float]) -> float:
    """HF Trainer.evaluation_loop's eval_loss from per-batch losses.

    Each batch's loss is repeated eval_batch_size times (a short last batch too: the configured
    size, not the observed one), so every batch weighs the same; non-finite losses are dropped
    first (logging_nan_inf_filter, on by default) unless all are.
    """
    losses = np.asarray(batch_losses, np.float64)
    finite = np.isfinite(losses)
    return float(losses[finite].mean() if finite.any() else losses.mean())


def _evaluate(model: CausalLM, lora, features: list[dict], batch_size: int, length: int, collate=None) -> float:
    """HF eval_loss over features in order; every eval batch is padded to [batch_size, length] (one
    compile; filler rows carry no labels, so each batch's token mean is unchanged). `collate`: a vision-language
    task's collator (pad_to_length=length); text rows are padded with 0 (masked and unlabelled)."""
    collate = collate or SFTDataCollator(pad_token_id=0, pad_to_length=length)
    fn = _eval_fn(model.module)
    losses = []
    for s in range(0, len(features), batch_size):
        batch = _pad_batch(_embedded(model, collate(features[s:s + batch_size])), batch_size, length, 0)
        losses.append(fn(model.params, lora, batch))
    return mean_of_batch_losses(jax.device_get(losses))


def _bucket_length(features: list[dict], extra: int = 0) -> int:
    """The longest row (<= cutoff_len after preprocessing) plus `extra` (LF's fake media on row 0 of a
    vision-language batch), rounded up to a multiple of 8."""
    return -(-(max(len(f["input_ids"]) for f in features) + extra) // 8) * 8


def _fake_media_length(mm) -> int:
    """The most tokens LF's collator appends to row 0: the fake image's, and Omni's fake audio's."""
    return 0 if mm is None else len(fake_input_ids(mm.tokenizer, mm.plugin))


def evaluate_loss(model_dir, lora_state_dict: dict | None, eval_features: list[dict], args: TrainArgs,
                  tokenizer_dir=None, data_dir=None) -> float:
    """HF eval_loss over eval_features (processed rows) in batches of per_device_eval_batch_size:
    the mean of each batch's token-mean CE. The base model when lora_state_dict is None. A vision-language
    task's rows need its tokenizer_dir and data_dir (their images; LF's fake image for an image-free batch)."""
    model = load_model(model_dir, lora_config(args))
    lora = None if lora_state_dict is None else lora_tree_from_state_dict(lora_state_dict)
    mm = None if tokenizer_dir is None else multimodal_context(args, tokenizer_dir, data_dir,
                                                               getattr(model.module, "rope_index", None))
    length = _bucket_length(eval_features, _fake_media_length(mm))
    collate = None if mm is None else SFTDataCollator(pad_token_id=0, pad_to_length=length, mm=mm)
    return _evaluate(model, lora, eval_features, args.per_device_eval_batch_size, length, collate)


def train_sft(model_dir, tokenizer_dir, data_dir, args: TrainArgs = TrainArgs()) -> SFTResult:
    """End to end from data_dir/{train,eval}.json (alpaca rows) to a trained adapter."""
    start = time.perf_counter()
    train = load_processed_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_processed_dataset(tokenizer_dir, data_dir, "eval", args)
    model = load_model(model_dir, lora_config(args))
    rope_index = getattr(model.module, "rope_index", None)  # M-RoPE models: LF's collator asks the model
    mm = multimodal_context(args, tokenizer_dir, data_dir, rope_index)
    length = _bucket_length(train + held_out, _fake_media_length(mm))  # one static shape for every batch
    collate = make_collator(args, tokenizer_dir, pad_to_length=length, data_dir=data_dir, rope_index=rope_index)
    eval_collate = None if mm is None else SFTDataCollator(pad_token_id=0, pad_to_length=length, mm=mm)
    lora = init_lora_tree(model.params, lora_config(args), args.seed)
    # lora_B starts at zero, so the adapted model is exactly the base model: evaluating it
    # instead of the lora-free model reuses the eval compile of the trained adapter.
    eval_batch = args.per_device_eval_batch_size
    eval_loss_before = _evaluate(model, lora, held_out, eval_batch, length, eval_collate)
    tx = _lora_optimizer(args, num_training_steps(len(train), args))
    steps = (
        [collate([train[i] for i in idx]) for idx in step]
        for epoch in range(args.num_train_epochs)
        for step in step_example_indices(len(train), args, epoch)
    )
    shape = (args.gradient_accumulation_steps, args.per_device_train_batch_size, length)
    step_losses, lora = _run_steps(model, lora, tx, steps, collate.pad_token_id, shape)
    eval_loss_after = _evaluate(model, lora, held_out, eval_batch, length, eval_collate)
    return SFTResult(step_losses, eval_loss_before, eval_loss_after, lora_state_dict(lora),
                     time.perf_counter() - start)
