"""LoRA PPO of Llama 3 the way LLaMA-Factory runs it (stage ppo, finetuning_type lora, reward_model_type
full), on TRL v0.9.6's PPOTrainer.step, in eager PyTorch.

raw alpaca json -> llama3 template -> unsupervised processor (the prompt through the assistant header)
-> left-padded prompt batches -> per PPO step (LF CustomPPOTrainer.ppo_train):

1. rollouts, one mini-batch at a time: the policy (LoRA on, eval mode) samples up to max_new_tokens
   with LF's generating args (temperature, then top-k, then top-p, as HF's warpers run); LF's rule trims
   each query's left pad and cuts each response (last non-pad + 1, + 1 more when pad == eos);
2. scores: the reward model (a full checkpoint with TRL's value head, as LF's `reward_model_type: full`
   loads it) at the last token of query + response, right-padded;
3. TRL's step: old log-probs and values of the policy, reference log-probs with the adapter disabled
   (LoRA with no ref_model), per-token KL penalty -kl_coef (logp - ref logp) with the score added at the
   last response token, GAE (gamma, lam) and whitening of the advantages over the whole batch, then
   ppo_epochs passes over a fresh permutation in mini-batches: clipped policy loss + vf_coef x clipped
   value loss, each mini-batch's loss / GA backward, clip and AdamW step every GA mini-batches (accelerate);
   the adaptive (or fixed) KL controller updates, the LR schedule steps once per PPO step.

Vision-language policies (qwen2_vl and kin, the fixed-size towers; their template's mm plugin). LF 0.9.5's own
PPO cannot run a Qwen-VL model: TRL 0.9.6's value head reads config.hidden_size (a VL config keeps it in its text
config), and generation gets only input_ids and attention_mask, so the images never reach the model. The VL path
here is LF's PPO with the multimodal collator's inputs passed where a VL model needs them:
- prompts collated by PromptDataCollator(pad, mm=MultimodalContext(template.mm_plugin, tokenizer, media_dir,
  model.rope_index)): pixel_values, image_grid_thw, the prompt's M-RoPE position_ids and rope_deltas;
- the frozen tower runs once per step batch (encode_images); its image features (the merged patches, and
  Qwen3-VL's DeepStack features) are kept per token (`token_<keyword>` f32[B,T,...], read at the image tokens
  only);
- generation merges them at the prompt's image tokens; positions: the prompt's from the rope index, each new
  token's its text position (mask cumsum - 1) + the row's rope_delta on all three rows (mrope.decode_positions),
  as transformers' generate does; a generated image-pad token is embedded as text (no DeepStack), as generate's
  decode steps do;
- TRL's batched forward pass (policy, reference) sees the same images at the query's image tokens and the
  positions of query + response: the query's own, then text continuing after its last position (the rope index
  of the concatenated row, computed from its parts: a response token that happens to be the image-pad id stays
  text, where transformers' forward would fail on the count);
- the reward model (a text checkpoint) scores the query + response ids as before, no pixels;
- the value head reads the language model's final hidden states (the text config's hidden_size);
- Qwen2.5-Omni's thinker: every prompt batch carries LF's fake audio (input_features, feature_attention_mask, its
  audio tokens masked on row 0 before the prompt), so the audio tower runs once per step batch too (encode_audio)
  and its rows travel per token like the image features (token_audio_embeds, at the audio tokens: generation
  merges them there; a sampled audio token carries its text embedding). LF's Omni branch hands rope deltas against
  the absolute column (minus each row's masked tokens); generation continues the text positions, so an Omni
  prompt's deltas are taken as the largest position + 1 - the attended tokens (the same decode positions). A
  sampled video token is text (video_tokens_as_text), as generate's decode steps embed it; the fake audio, like
  the fake image, never reaches a query;
- the fixed-size towers (gemma3, paligemma, llava_next, internvl: no grids, no rope index) take the same path
  without M-RoPE: the tower's rows (each family's encode_images on the pixels, LLaVA-NeXT's with image_sizes) kept
  per token as above (a generated image token embeds as text); generation at text positions (mask cumsum - 1),
  Gemma 3's and PaliGemma's with the prompt's token_type_ids (left-padded with 0), each new token taking the
  prompt's last type as HF's generate extends them (Gemma 3: 0, text; PaliGemma: LF's 1, the causal suffix);
  TRL's forward passes no positions (0..L-1; PaliGemma's 1..L, its own numbering) and the query's types, then
  that type over the response, pads 0. Gemma 3's and PaliGemma's forwards take no position_ids, so their
  generation runs at the model's own positions on the left-padded rows (each row's real tokens shifted by its
  pad count): RoPE reads position differences only, so each row's attention is HF's (mask cumsum - 1, PaliGemma's
  + 1) up to rounding.
Departure from LF: a step batch without any image gets LF's fake image before row 0's tokens (mask 0), and LF's
trimming (the first non-pad token) would keep its tokens in the query, to be attended with no pixels; here the
query of a VL batch starts at its first attended token, so the fake image never reaches TRL's forward.

The value head is TRL's: Dropout(summary_dropout_prob) -> Linear(hidden, 1) on the final hidden state
(after the final norm). Recorded with its dropout off (`value_head_dropout: 0.0`; TRL's default is 0.1
and LF leaves it live in training): torch's dropout masks cannot be shared with another framework.

What is framework-independent here, by construction (each side implements the same numpy draws):
- the value head's init: uniform(+-1/sqrt(hidden)) for weight and bias, nn.Linear's default
  distribution, from np.random.default_rng([seed, 1]);
- the prompt order: epoch e visits the prompts in np.random.default_rng(seed + e).permutation order,
  batch_size prompts a step, the last partial batch dropped (TRL's dataloader, drop_last);
- the sampling noise: HF's torch.multinomial is replaced by the exponential race argmax(p / q) with
  q ~ Exp(1) from np.random.default_rng([seed, 2, step, mini-batch]) (the same distribution);
- the PPO mini-batch order: TRL's np.random.permutation(bs) per PPO epoch, drawn from
  np.random.default_rng([seed, 3, step]).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file

from torch_sources.models import mrope

from .collator import MultimodalContext, PromptDataCollator
from .lora import PEFT_PREFIX, disable_adapter, load_lora_state_dict, lora_state_dict
from .optimizer import clip_grad_norm, create_optimizer
from .processor import preprocess_unsupervised_dataset
from .sft import TrainArgs, _fixed_tokenizer, load_model, lora_config, media_dir, multimodal_context

__all__ = ["PPOArgs", "PPOResult", "STATS", "VALUE_HEAD_FILE", "load_prompt_dataset", "make_collator",
           "prompt_batch_indices", "num_training_steps", "init_value_head", "value_head",
           "CausalLMWithValueHead", "load_policy", "load_reward_model", "value_head_state_dict",
           "load_value_head_state_dict", "generation_ids", "rollout_noise", "eval_noise", "warp_logits", "sample_next_tokens",
           "prompt_vision", "generate", "trim_rollouts", "prepare_model_inputs", "get_rewards", "logprobs_from_logits",
           "batched_forward_pass", "masked_mean", "masked_var", "masked_whiten", "compute_rewards",
           "compute_advantages", "ppo_loss", "AdaptiveKLController", "FixedKLController", "ppo_step",
           "ppo_step_loss_and_grads", "rollout", "train_steps", "evaluate_reward", "train_ppo"]

VALUE_HEAD_FILE = "value_head.safetensors"  # LF load_valuehead_params: v_head.summary.{weight,bias}
# numpy streams: [seed, stream, ...]
_VALUE_HEAD, _ROLLOUT, _MINIBATCH, _EVAL = 1, 2, 3, 4

# TRL's step statistics that the PPO result logs per step (each the mean over the step's mini-batches where
# TRL averages, as record_step_stats does), in this order.
STATS = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy", "ppo/policy/approxkl",
         "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages_mean", "ppo/returns/mean",
         "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var",
         "ppo/val/var_explained", "objective/kl", "objective/kl_coef", "objective/entropy",
         "ppo/mean_non_score_reward", "ppo/mean_scores", "ppo/std_scores")


@dataclass(frozen=True)
class PPOArgs(TrainArgs):
    """TrainArgs plus LF's ppo_* finetuning arguments, the TRL PPOConfig fields LF leaves at their defaults,
    and LF's generating arguments (max_new_tokens cut down for the tiny model)."""

    ppo_epochs: int = 4
    ppo_buffer_size: int = 1
    ppo_target: float = 6.0
    ppo_score_norm: bool = False
    ppo_whiten_rewards: bool = False
    init_kl_coef: float = 0.2
    adap_kl_ctrl: bool = True
    horizon: float = 10000.0
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ratio_threshold: float = 10.0
    kl_penalty: str = "kl"
    max_new_tokens: int = 16
    temperature: float = 0.95
    top_k: int = 50
    top_p: float = 0.7
    value_head_dropout: float = 0.0
    eval_samples: int = 4  # held-out responses per prompt (evaluate_reward)

    def __post_init__(self):
        super().__post_init__()
        if self.kl_penalty != "kl":
            raise NotImplementedError(f"kl_penalty {self.kl_penalty!r}: only TRL's default 'kl' is implemented")
        if self.ppo_score_norm:
            raise NotImplementedError("ppo_score_norm needs TRL's running moments; LF's default is off")
        if self.value_head_dropout != 0.0:
            raise NotImplementedError("value-head dropout masks cannot be shared across frameworks: record it off")

    @property
    def mini_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def batch_size(self) -> int:  # LF: per_device_bs x GA x ppo_buffer_size
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.ppo_buffer_size


@dataclass(frozen=True)
class PPOResult:
    step_stats: dict[str, list[float]]  # STATS name -> one value per PPO step
    step_responses: list[np.ndarray]  # per PPO step: i64[batch, max_new_tokens], the cut responses, -1 padded
    eval_before: float  # mean held-out reward (evaluate_reward), the policy at its init
    eval_after: float
    lora_state_dict: dict[str, np.ndarray]
    value_head: dict[str, np.ndarray]
    wall_clock_s: float


# ---- data --------------------------------------------------------------------------------------

def load_prompt_dataset(tokenizer_dir, data_dir, split: str, args: PPOArgs) -> list[dict]:
    """data_dir/{split}.json (alpaca rows, with an `images` column for a vision-language template) through the
    template and the unsupervised processor."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    rows = json.loads((Path(data_dir) / f"{split}.json").read_text())
    return preprocess_unsupervised_dataset(rows, tokenizer, template, args.cutoff_len, media_dir(args, data_dir))


def make_collator(args: PPOArgs, tokenizer_dir=None, data_dir=None, rope_index=None) -> PromptDataCollator:
    """The prompt collator; a vision-language template's also reads the rows' images (from data_dir, or
    args.media_dir) and takes the model's rope_index."""
    if tokenizer_dir is None:
        return PromptDataCollator(pad_token_id=0)
    return PromptDataCollator(pad_token_id=_fixed_tokenizer(tokenizer_dir, args)[1].pad_token_id,
                              mm=multimodal_context(args, tokenizer_dir, data_dir, rope_index))


def generation_ids(tokenizer_dir, args: PPOArgs) -> tuple[tuple[int, ...], int]:
    """(eos ids, pad id) that LF's generation config carries: [eos] + the template's other stop words."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    eos = [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(w) for w in template.stop_words[1:]]
    return tuple(dict.fromkeys(eos)), tokenizer.pad_token_id


def prompt_batch_indices(num_examples: int, args: PPOArgs, epoch: int) -> list[np.ndarray]:
    """The prompt indices of every PPO step of one epoch (batch_size each, the last partial batch dropped)."""
    order = np.random.default_rng(args.seed + epoch).permutation(num_examples)
    return [order[s:s + args.batch_size] for s in range(0, num_examples - args.batch_size + 1, args.batch_size)]


def num_training_steps(num_examples: int, args: PPOArgs) -> int:
    """LF CustomPPOTrainer: epochs x ceil(N / (backward batch x buffer)), the LR schedule's length."""
    return args.num_train_epochs * math.ceil(num_examples / args.batch_size)


# ---- the value head ------------------------------------------------------------------------------

def init_value_head(hidden_size: int, seed: int) -> dict[str, np.ndarray]:
    """TRL's v_head.summary = nn.Linear(hidden, 1): its default init's distribution, from numpy."""
    bound = 1.0 / math.sqrt(hidden_size)
    rng = np.random.default_rng([seed, _VALUE_HEAD])
    return {"v_head.summary.weight": rng.uniform(-bound, bound, (1, hidden_size)).astype(np.float32),
            "v_head.summary.bias": rng.uniform(-bound, bound, (1,)).astype(np.float32)}


def value_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """f32[..., D] x f32[1, D] + f32[1] -> f32[...] (TRL ValueHead.summary, then the wrapper's squeeze(-1))."""
    return F.linear(hidden.float(), weight, bias).squeeze(-1)


class ValueHead(nn.Module):
    """TRL ValueHead: dropout (off here, see the module docstring) -> Linear(hidden, 1) in fp32."""

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden):  # f32[B,T,D] -> f32[B,T]
        return value_head(self.dropout(hidden), self.summary.weight, self.summary.bias)


class CausalLMWithValueHead(nn.Module):
    """TRL AutoModelForCausalLMWithValueHead: (fp32 logits, values) from one forward."""

    def __init__(self, pretrained_model: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(pretrained_model.config.hidden_size, dropout)

    def forward(self, input_ids, attention_mask, position_ids=None, **inputs):  # -> f32[B,T,V], f32[B,T]
        """inputs: a VL model's keywords (the tower's image_embeds, Qwen3-VL's deepstack_embeds, Omni's
        audio_embeds, Gemma 3's and PaliGemma's token_type_ids). position_ids only when given: Gemma 3's and
        PaliGemma's forwards take none (their own 0..T-1 / 1..T)."""
        positions = {} if position_ids is None else {"position_ids": position_ids}
        logits, hidden = self.pretrained_model(input_ids, attention_mask, return_hidden=True, **positions, **inputs)
        return logits.float(), self.v_head(hidden)


def value_head_state_dict(model: CausalLMWithValueHead) -> dict[str, np.ndarray]:
    return {f"v_head.{n}": p.detach().cpu().numpy().copy() for n, p in model.v_head.named_parameters()}


def load_value_head_state_dict(model: CausalLMWithValueHead, state_dict: dict) -> None:
    expected = set(value_head_state_dict(model))
    if set(state_dict) != expected:
        raise KeyError(f"value head names differ: expected {sorted(expected)}, got {sorted(state_dict)}")
    with torch.no_grad():
        for n, p in model.v_head.named_parameters():
            p.copy_(torch.as_tensor(np.asarray(state_dict[f"v_head.{n}"]), dtype=p.dtype))


def load_policy(model_dir, args: PPOArgs, lora_init: dict | None = None,
                value_head_init: dict | None = None) -> CausalLMWithValueHead:
    """The checkpoint with LoRA (from args.seed, or lora_init) and a value head (init_value_head(args.seed),
    or value_head_init); base frozen, adapters and value head trainable."""
    model = CausalLMWithValueHead(load_model(model_dir, lora_config(args), args.seed), args.value_head_dropout)
    if lora_init is not None:
        load_lora_state_dict(model.pretrained_model, lora_init)
    load_value_head_state_dict(model, value_head_init or init_value_head(model.pretrained_model.config.hidden_size,
                                                                         args.seed))
    return model


def load_reward_model(reward_model_dir) -> CausalLMWithValueHead:
    """LF create_reward_model, reward_model_type full: the checkpoint with its value_head.safetensors, eval mode."""
    path = Path(reward_model_dir) / VALUE_HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: a full reward model needs its value head (LF load_valuehead_params)")
    model = CausalLMWithValueHead(load_model(reward_model_dir))
    load_value_head_state_dict(model, load_file(str(path)))
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


# ---- rollouts ------------------------------------------------------------------------------------

def rollout_noise(seed: int, step: int, batch_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Exp(1) noise f32[B, max_new_tokens, V] of one generation mini-batch (the exponential race's q)."""
    return np.random.default_rng([seed, _ROLLOUT, step, batch_index]).exponential(size=shape).astype(np.float32)


def eval_noise(sample: int, batch_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Exp(1) noise of held-out sample `sample` of eval batch `batch_index`: the same for every run and seed."""
    return np.random.default_rng([_EVAL, sample, batch_index]).exponential(size=shape).astype(np.float32)


def warp_logits(logits: torch.Tensor, args: PPOArgs) -> torch.Tensor:
    """HF's sampling warpers in generate's order: temperature, top-k (ties at the k-th kept), top-p (the
    smallest set whose mass exceeds top_p, at least one token); removed tokens get -inf."""
    scores = logits.float() / args.temperature
    if 0 < args.top_k < scores.shape[-1]:
        kth = torch.topk(scores, args.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if args.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - args.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, sorted_idx, remove), -float("inf"))
    return scores


def sample_next_tokens(logits: torch.Tensor, noise: torch.Tensor, args: PPOArgs) -> torch.Tensor:
    """f32[B,V] logits, f32[B,V] Exp(1) noise -> i64[B]: argmax(softmax(warped) / noise)."""
    probs = warp_logits(logits, args).softmax(dim=-1)
    return (probs / noise).argmax(dim=-1)


_TOKEN = "token_"  # a VL batch's per-token tower features: token_<keyword> f32[B,T,...]
# the token a keyword's rows replace (config attribute): the image keywords the image-pad token's, Omni's audio rows
# (audio_embeds, encode_audio's output) the audio token's
_IMAGE_FEATURES = ("image_embeds", "deepstack_embeds")
_AUDIO_FEATURES = ("audio_embeds",)


def _feature_token(config, keyword: str) -> int:
    return config.audio_token_id if keyword in _AUDIO_FEATURES else config.image_token_id


def _token_features(inputs: dict) -> dict:  # -> {keyword: f32[B,T,...]} (token_type_ids is no tower feature)
    return {k: inputs[_TOKEN + k] for k in _IMAGE_FEATURES + _AUDIO_FEATURES if _TOKEN + k in inputs}


def _encode_images(lm, batch: dict) -> dict[str, torch.Tensor]:
    """The tower's output as the forward's image keywords: a family's dict (Qwen3-VL: image_embeds f32[n,D],
    deepstack_embeds f32[n,K,D]), or its rows alone (image_embeds). Qwen-VL's encode_images takes the pixels and
    grids, LLaVA-NeXT's the pixels and image sizes, the other fixed-size towers' the pixels."""
    media = [batch[k] for k in ("image_grid_thw", "image_sizes") if k in batch]
    encoded = lm.encode_images(batch["pixel_values"], *media)
    return {k: v.float() for k, v in (encoded if isinstance(encoded, dict) else {"image_embeds": encoded}).items()}


def _text_features(model: CausalLMWithValueHead, features: dict) -> dict:  # -> {keyword: f32[...]}
    """What a generated image-pad (or audio) token carries: it is text (as generate's decode steps embed it), so
    its merged patch (its audio row) is the token's own text embedding and an added feature (DeepStack's) is zero
    (x + 0 = x)."""
    lm = model.pretrained_model

    def text(token_id):
        return lm.embed(torch.tensor([[token_id]]))[0, 0].detach()
    return {k: text(lm.config.image_token_id) if k == "image_embeds"
            else text(lm.config.audio_token_id) if k in _AUDIO_FEATURES else torch.zeros(v.shape[2:])
            for k, v in features.items()}


def _text_deltas(position_ids, attention_mask):  # i64[3,B,P], {0,1}[B,P] -> i64[B,1]
    """Each row's rope delta against its text positions (mask cumsum - 1, what decode_positions continues): the
    largest position + 1 - the row's attended tokens. An Omni batch needs it: LF's Omni branch hands the collator's
    rope_deltas minus each row's masked tokens (pads, fake media) at LF's width, deltas against the absolute
    column (transformers' Omni cache_position); a query + response row continues its query either way."""
    return position_ids.amax(dim=(0, 2))[:, None] + 1 - attention_mask.long().sum(-1, keepdim=True)


@torch.no_grad()
def prompt_vision(model: CausalLMWithValueHead, batch: dict) -> dict | None:
    """A collated VL prompt batch -> {position_ids i64[3,B,P], rope_deltas i64[B,1], token_<keyword> f32[B,P,...]:
    the tower's image features at the image tokens (reading order), 0 elsewhere}; None for a text batch. An Omni
    batch (LF's fake audio: input_features, feature_attention_mask) adds the audio tower's rows at its (masked)
    audio tokens, token_audio_embeds, and its rope deltas are taken against the text positions (_text_deltas). A
    fixed-size tower's batch (no grids) has no M-RoPE: {token_image_embeds, and Gemma 3's and PaliGemma's
    token_type_ids i64[B,P] (the collator's, left-padded with 0)}."""
    if "pixel_values" not in batch:
        return None
    lm = model.pretrained_model
    ids = batch["input_ids"]
    encoded = _encode_images(lm, batch)
    if "input_features" in batch:
        encoded["audio_embeds"] = lm.encode_audio(batch["input_features"], batch["feature_attention_mask"]).float()
    per_token = {}
    for k, rows in encoded.items():
        per_token[_TOKEN + k] = torch.zeros(*ids.shape, *rows.shape[1:])
        per_token[_TOKEN + k][ids == _feature_token(lm.config, k)] = rows
    if "image_grid_thw" not in batch:  # a fixed-size tower: text positions
        types = {"token_type_ids": batch["token_type_ids"].long()} if "token_type_ids" in batch else {}
        return {**per_token, **types}
    position_ids = batch["position_ids"].long()
    deltas = (_text_deltas(position_ids, batch["attention_mask"]) if "input_features" in batch
              else batch["rope_deltas"].long())
    return {"position_ids": position_ids, "rope_deltas": deltas, **per_token}


def _image_inputs(model: CausalLMWithValueHead, input_ids, features: dict) -> dict:  # -> {keyword: f32[n,...]}
    """The forward's tower keywords: the per-token features at their tokens (image, or Omni's audio), in reading
    order. Omni's thinker (the audio keyword's) also takes a sampled video token as text (video_tokens_as_text):
    its positions are given, and generate's decode steps embed it so."""
    config = model.pretrained_model.config
    out = {k: v[input_ids == _feature_token(config, k)] for k, v in features.items()}
    return {**out, "video_tokens_as_text": True} if any(k in _AUDIO_FEATURES for k in out) else out


def _text_positions(mask):  # {0,1}[B,T] (left padding) -> i64[B,T]: HF generate's, mask cumsum - 1 (1 on pads)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _tower_inputs(vision: dict, mask, t: int) -> dict:
    """A fixed-size tower's forward keywords in generation's step t, beside the image rows: Gemma 3's and
    PaliGemma's token types (the prompt's, then its last type for the t new tokens: 0 for Gemma 3, LF's 1 for
    PaliGemma); the others' text positions. Gemma 3's and PaliGemma's forwards take no position_ids: they run at
    their own (0..T-1, PaliGemma's 1..T) on the left-padded rows, each row's real tokens shifted by its pad
    count; RoPE reads position differences only, so each row's attention is HF's up to rounding."""
    if "token_type_ids" not in vision:
        return {"position_ids": _text_positions(mask)}
    types = vision["token_type_ids"]
    return {"token_type_ids": torch.cat([types, types[:, -1:].expand(-1, t)], dim=1)}


@torch.no_grad()
def generate(model: CausalLMWithValueHead, input_ids, attention_mask, noise, args: PPOArgs,
             eos_token_ids, pad_token_id: int, vision: dict | None = None) -> torch.Tensor:
    """HF generate (do_sample) from left-padded prompts: i64[B,P] -> i64[B, max_new_tokens]; after a
    row's eos every token is pad_token_id. Positions are HF's: attention-mask cumsum - 1 (1 on pads).
    vision (prompt_vision's, these rows): the prompt's image embeddings and M-RoPE positions; new tokens at
    their text position + the row's rope delta (mrope.decode_positions), embedded as text. A fixed-size tower's:
    the image rows, text positions, and Gemma 3's and PaliGemma's token types, each new token taking the prompt's
    last type (HF's _update_model_kwargs_for_generation); their forwards take no positions (see _tower_inputs)."""
    ids, mask = input_ids.long(), attention_mask.long()
    if vision is not None:
        prompt_features = _token_features(vision)
        text = _text_features(model, prompt_features)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    eos = torch.tensor(list(eos_token_ids))
    out = []
    for t in range(args.max_new_tokens):
        if vision is None:
            inputs = {"position_ids": _text_positions(mask)}
        else:
            features = {k: torch.cat([v, text[k].expand(ids.shape[0], t, *text[k].shape)], dim=1)
                        for k, v in prompt_features.items()}
            inputs = _image_inputs(model, ids, features)
            if "position_ids" in vision:
                new_positions = mrope.decode_positions(mask, vision["rope_deltas"])[..., input_ids.shape[1]:]
                inputs["position_ids"] = torch.cat([vision["position_ids"], new_positions], dim=-1)
            else:
                inputs.update(_tower_inputs(vision, mask, t))
        logits = model.pretrained_model(ids, mask, **inputs)[:, -1].float()
        token = sample_next_tokens(logits, torch.as_tensor(np.asarray(noise[:, t])), args)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        finished |= torch.isin(token, eos)
        out.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
    return torch.stack(out, dim=1)


def trim_rollouts(query_ids, response_ids, pad_token_id: int, eos_token_id: int, attention_mask=None):
    """LF get_inputs: each query without its left pad; each response cut after its last non-pad token, one
    token further when pad == eos (keeping the eos), to one token when it is all pad -> two lists of i64 rows.
    attention_mask (a VL batch's): each query starts at its first attended token (LF's fake image stays out)."""
    queries, responses = [], []
    for i, (q, r) in enumerate(zip(query_ids, response_ids)):
        start = int((q != pad_token_id).nonzero()[0]) if attention_mask is None else int(attention_mask[i].nonzero()[0])
        kept = (r != pad_token_id).nonzero()
        if len(kept) == 0:
            length = 1
        elif eos_token_id == pad_token_id:
            length = int(kept[-1]) + 2
        else:
            length = int(kept[-1]) + 1
        queries.append(q[start:])
        responses.append(r[:length])
    return queries, responses


def prepare_model_inputs(queries, responses, pad_token_id: int, vision: dict | None = None) -> dict[str, torch.Tensor]:
    """TRL prepare_model_inputs with LF's collator on the right: query + response, right-padded to the longest.
    vision (rollout's, per row: the query's positions i64[3,q], per-token image features token_<keyword>
    f32[q,...], rope delta; and the image-pad token's text features) adds row_positions i64[B,3,L] (the query's,
    then text: column j at j + delta; pads 0) and the per-token features f32[B,L,...] (the query's; the text
    features on the response). A fixed-size tower's (no positions: TRL's forward passes none, so 0..L-1, or
    PaliGemma's 1..L) adds Gemma 3's and PaliGemma's token_type_ids i64[B,L]: the query's, then its last type (the
    generated tokens' text type) over the response; pads 0."""
    rows = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    length = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, x in enumerate(rows):
        input_ids[i, :len(x)] = x
        attention_mask[i, :len(x)] = 1
    out = {"input_ids": input_ids, "attention_mask": attention_mask}
    if vision is None:
        return out
    text = vision["text_features"]
    features = {k: torch.zeros((len(rows), length, *v.shape)) for k, v in text.items()}
    for i, q in enumerate(queries):
        for k, v in features.items():
            v[i, :len(q)] = vision[_TOKEN + k][i]
            v[i, len(q):] = text[k]
    out.update({_TOKEN + k: v for k, v in features.items()})
    if "positions" in vision:
        out["row_positions"] = torch.zeros((len(rows), 3, length), dtype=torch.long)
        for i, (q, x) in enumerate(zip(queries, rows)):
            out["row_positions"][i, :, :len(q)] = vision["positions"][i]
            out["row_positions"][i, :, len(q):len(x)] = torch.arange(len(q), len(x)) + vision["rope_deltas"][i]
    if "token_type_ids" in vision:
        out["token_type_ids"] = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (q, x) in enumerate(zip(queries, rows)):
            types = vision["token_type_ids"][i]
            out["token_type_ids"][i, :len(q)] = types
            out["token_type_ids"][i, len(q):len(x)] = types[-1]
    return out


@torch.no_grad()
def get_rewards(reward_model: CausalLMWithValueHead, queries, responses, pad_token_id: int) -> torch.Tensor:
    """LF get_rewards (full reward model): the value head at attention_mask.sum - 1 of the right-padded
    query + response -> f32[B]."""
    batch = prepare_model_inputs(queries, responses, pad_token_id)
    _, values = reward_model(batch["input_ids"], batch["attention_mask"])
    last = batch["attention_mask"].sum(dim=-1, keepdim=True) - 1
    return values.gather(dim=-1, index=last).squeeze(-1).float()


# ---- TRL's step --------------------------------------------------------------------------------

def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.gather(F.log_softmax(logits, dim=2), 2, labels.unsqueeze(2)).squeeze(-1)


def batched_forward_pass(model: CausalLMWithValueHead, queries, responses, model_inputs: dict,
                         mini_batch_size: int, return_logits: bool = False):
    """LF's override of TRL batched_forward_pass, in mini_batch_size chunks -> (logprobs f32[B,L-1], logits
    f32[B,L-1,V] or None, values f32[B,L-1], masks i64[B,L-1]): the mask covers the response tokens."""
    all_logprobs, all_logits, all_values, all_masks = [], [], [], []
    for s in range(0, len(queries), mini_batch_size):
        input_ids = model_inputs["input_ids"][s:s + mini_batch_size]
        attention_mask = model_inputs["attention_mask"][s:s + mini_batch_size]
        # a VL batch: its image features, Qwen-VL's M-RoPE positions, Gemma 3's and PaliGemma's token types
        features = {k: v[s:s + mini_batch_size] for k, v in _token_features(model_inputs).items()}
        inputs = _image_inputs(model, input_ids, features)
        if "row_positions" in model_inputs:
            inputs["position_ids"] = model_inputs["row_positions"][s:s + mini_batch_size].transpose(0, 1)
        if "token_type_ids" in model_inputs:
            inputs["token_type_ids"] = model_inputs["token_type_ids"][s:s + mini_batch_size]
        logits, values = model(input_ids, attention_mask, **inputs)
        logprobs = logprobs_from_logits(logits[:, :-1, :], input_ids[:, 1:])
        masks = torch.zeros_like(attention_mask)
        masks[:, :-1] = attention_mask[:, 1:]
        for j in range(len(input_ids)):
            start = len(queries[s + j]) - 1
            if attention_mask[j, 0] == 0:  # left padding (never here: TRL's inputs are right-padded)
                start += int(attention_mask[j, :].nonzero()[0])
            end = start + len(responses[s + j])
            masks[j, :start] = 0
            masks[j, end:] = 0
        if return_logits:
            all_logits.append(logits)
        all_values.append(values)
        all_logprobs.append(logprobs)
        all_masks.append(masks)
    return (torch.cat(all_logprobs), torch.cat(all_logits)[:, :-1] if return_logits else None,
            torch.cat(all_values)[:, :-1], torch.cat(all_masks)[:, :-1])


def masked_mean(values, mask, axis=None):
    if axis is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def masked_var(values, mask):
    """TRL masked_var, unbiased (the only form its PPO uses): the masked mean of squared deviations, times
    n / (n - 1) (Bessel) over n = mask.sum(); inf for a single element, as TRL's."""
    mask_sum = mask.sum()
    if mask_sum == 0:
        raise ValueError("masked_var: the mask is empty")
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * (mask_sum / (mask_sum - 1))


def masked_whiten(values, mask, shift_mean: bool = True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef: float):
    """TRL compute_rewards (kl_penalty "kl"): (rewards, non-score rewards, kls), each f32[B,L-1]; the score
    is added at each row's last masked position."""
    kls = logprobs - ref_logprobs
    non_score = -kl_coef * kls
    rewards = non_score.clone()
    for i in range(len(scores)):
        last = masks[i].nonzero()[-1]
        rewards[i, last] += scores[i]
    return rewards, non_score, kls


def compute_advantages(values, rewards, mask, gamma: float, lam: float, whiten_rewards: bool = False,
                       width=None):
    """TRL compute_advantages: GAE backwards over every position, returns = advantages + values, advantages
    whitened over the whole batch -> (masked values, advantages, returns). Whitened rewards are nonzero at
    masked positions too (TRL's quirk), so the batch's width matters; `width` (default: every position)
    is for a twin whose buffers are wider than the batch."""
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
        if width is not None:
            rewards = rewards * (torch.arange(rewards.shape[-1]) < width)
    lastgaelam, reversed_adv = 0.0, []
    gen_len = rewards.shape[-1]
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1]).transpose(0, 1)
    returns = advantages + values
    return values, masked_whiten(advantages, mask).detach(), returns


def _entropy_from_logits(logits):
    pd = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def ppo_loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, args: PPOArgs):
    """TRL PPOTrainer.loss -> (policy loss, vf_coef x value loss, {stat name: f32 scalar}); both losses are 0
    when the mean ratio passes ratio_threshold."""
    vpredclipped = torch.clamp(vpreds, values - args.cliprange_value, values + args.cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses).float(), mask)
    loss = pg_loss + args.vf_coef * vf_loss
    if masked_mean(ratio, mask).item() > args.ratio_threshold:
        pg_loss, vf_loss, loss = pg_loss * 0.0, vf_loss * 0.0, loss * 0.0
    stats = {"loss/policy": pg_loss, "loss/value": vf_loss, "loss/total": loss,
             "policy/entropy": masked_mean(_entropy_from_logits(logits), mask),
             "policy/approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
             "policy/policykl": masked_mean(old_logprobs - logprobs, mask), "policy/clipfrac": pg_clipfrac,
             "policy/advantages_mean": masked_mean(advantages, mask),
             "returns/mean": masked_mean(returns, mask), "returns/var": masked_var(returns, mask),
             "val/vpred": masked_mean(vpreds, mask), "val/error": masked_mean((vpreds - returns) ** 2, mask),
             "val/clipfrac": vf_clipfrac, "val/mean": masked_mean(values, mask), "val/var": masked_var(values, mask)}
    return pg_loss, args.vf_coef * vf_loss, {k: v.detach().float() for k, v in stats.items()}


class AdaptiveKLController:
    """Ziegler et al.'s controller (TRL): value *= 1 + clip(kl / target - 1, +-0.2) x n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current: float, n_steps: int) -> None:
        pass


def _kl_controller(args: PPOArgs):
    if args.adap_kl_ctrl:
        return AdaptiveKLController(args.init_kl_coef, args.ppo_target, args.horizon)
    return FixedKLController(args.init_kl_coef)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


# the last two: a VL batch's (Qwen-VL's positions, Gemma 3's and PaliGemma's token types), with its token_ features
_MODEL_INPUTS = ("input_ids", "attention_mask", "row_positions", "token_type_ids")


def _minibatch_loss(model, mb: dict, args: PPOArgs):
    """One mini-batch's forward (with grads) and TRL loss -> (loss_p + loss_v, stats)."""
    inputs = {k: v for k, v in mb.items() if k in _MODEL_INPUTS or k.startswith(_TOKEN)}
    logprobs, logits, vpreds, _ = batched_forward_pass(model, mb["queries"], mb["responses"], inputs,
                                                       args.mini_batch_size, return_logits=True)
    loss_p, loss_v, stats = ppo_loss(mb["logprobs"], mb["values"], logits, vpreds, logprobs, mb["masks"],
                                     mb["advantages"], mb["returns"], args)
    return loss_p + loss_v, stats


def _step_batch(model, queries, responses, scores, kl_coef: float, args: PPOArgs, pad_token_id: int,
                vision: dict | None = None) -> dict:
    """The no-grad half of TRL's step: old log-probs and values, reference log-probs, rewards and advantages."""
    model_inputs = prepare_model_inputs(queries, responses, pad_token_id, vision)
    with torch.no_grad():
        logprobs, _, values, masks = batched_forward_pass(model, queries, responses, model_inputs,
                                                          args.mini_batch_size)
        with disable_adapter(model):
            ref_logprobs, _, _, _ = batched_forward_pass(model, queries, responses, model_inputs,
                                                         args.mini_batch_size)
        rewards, non_score, kls = compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef)
        values, advantages, returns = compute_advantages(values, rewards, masks, args.gamma, args.lam,
                                                         args.ppo_whiten_rewards)
    return {"queries": queries, "responses": responses, "logprobs": logprobs, "ref_logprobs": ref_logprobs,
            "values": values, "masks": masks, "advantages": advantages, "returns": returns, "kls": kls,
            "non_score_reward": non_score, "scores": scores, **model_inputs}


def _minibatch(batch: dict, idx) -> dict:
    out = {k: v[idx] for k, v in batch.items() if torch.is_tensor(v)}
    out.update(queries=[batch["queries"][i] for i in idx], responses=[batch["responses"][i] for i in idx])
    return out


def ppo_step_loss_and_grads(model, queries, responses, scores, args: PPOArgs, pad_token_id: int,
                            kl_coef: float | None = None, vision: dict | None = None) -> tuple[dict, dict, dict]:
    """TRL's first mini-batch of a step (rows 0..mini_batch_size-1, no permutation), no update -> (its
    loss terms {"policy", "value", "total"}, the batch tensors {name: array f32/i64[B, L-1]}, the grads of
    that mini-batch's loss (undivided) {PEFT or v_head name: array})."""
    batch = _step_batch(model, queries, responses, scores, args.init_kl_coef if kl_coef is None else kl_coef,
                        args, pad_token_id, vision)
    model.zero_grad(set_to_none=True)
    loss, stats = _minibatch_loss(model, _minibatch(batch, np.arange(args.mini_batch_size)), args)
    loss.backward()
    grads = {(PEFT_PREFIX + n[len("pretrained_model."):] if ".lora_" in n else n): p.grad.detach().numpy().copy()
             for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    terms = {k: float(stats[f"loss/{k}"]) for k in ("policy", "value", "total")}
    tensors = {k: batch[k].detach().numpy().copy() for k in ("logprobs", "ref_logprobs", "values", "masks",
                                                             "advantages", "returns", "kls")}
    return terms, tensors, grads


def ppo_step(model, optimizer, scheduler, kl_ctl, queries, responses, scores, args: PPOArgs, pad_token_id: int,
             step: int, vision: dict | None = None) -> dict[str, float]:
    """TRL PPOTrainer.step on one batch of rollouts (vision: a VL rollout's, see `rollout`) -> the STATS of this
    step."""
    batch = _step_batch(model, queries, responses, scores, kl_ctl.value, args, pad_token_id, vision)
    bs, backward = len(queries), args.mini_batch_size * args.gradient_accumulation_steps
    rng = np.random.default_rng([args.seed, _MINIBATCH, step])
    all_stats = []
    model.train()
    for _ in range(args.ppo_epochs):
        order = rng.permutation(bs)
        for b in range(0, bs, backward):
            for m in range(b, min(b + backward, bs), args.mini_batch_size):
                loss, stats = _minibatch_loss(model, _minibatch(batch, order[m:m + args.mini_batch_size]), args)
                (loss / args.gradient_accumulation_steps).backward()  # accelerate divides by GA
                all_stats.append(stats)
            if args.max_grad_norm > 0:  # the sync step of accelerator.accumulate
                clip_grad_norm(_trainable(model), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stats = _record_step_stats(batch, all_stats, kl_ctl.value)
    kl_ctl.update(stats["objective/kl"], args.batch_size)
    scheduler.step()
    return stats


def _record_step_stats(batch: dict, all_stats: list[dict], kl_coef: float) -> dict[str, float]:
    """TRL record_step_stats, the scalar ones: mini-batch stats averaged, KL and entropy summed per row."""
    mask = batch["masks"]
    mean_kl = (batch["kls"] * mask).sum(dim=-1).mean()
    stats = {f"ppo/{k}": float(torch.stack([s[k] for s in all_stats]).mean()) for k in all_stats[0]}
    stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    stats.update({"objective/kl": float(mean_kl), "objective/kl_coef": float(kl_coef),
                  "objective/entropy": float((-batch["logprobs"] * mask).sum(dim=-1).mean()),
                  "ppo/mean_non_score_reward": float(masked_mean(batch["non_score_reward"], mask)),
                  "ppo/mean_scores": float(batch["scores"].mean()), "ppo/std_scores": float(batch["scores"].std())})
    return {k: stats[k] for k in STATS}


# ---- the loop ----------------------------------------------------------------------------------

def rollout(model, reward_model, prompt_features: list[dict], args: PPOArgs, eos_token_ids, pad_token_id: int,
            step: int, noise: np.ndarray | None = None, mm: MultimodalContext | None = None):
    """LF ppo_train's rollout of one PPO step: per mini-batch of the left-padded step batch, generate, trim,
    score -> (queries, responses, scores f32[B]). Mini-batch m draws rollout_noise(seed, step, m), unless
    `noise` (f32[B, N, V]) is given. With `mm` (a VL template's collator context) the prompts bring their
    images and M-RoPE positions, and a fourth item comes back: the rows' vision inputs for ppo_step (per row
    the query's positions, per-token image features and rope delta, a fixed-size tower's the query's image
    features and Gemma's token types; the image-pad token's text features)."""
    collate = PromptDataCollator(pad_token_id, mm=mm)
    batch = collate(prompt_features)
    model.eval()
    vision = prompt_vision(model, batch)
    features = [] if vision is None else list(_token_features(vision))
    mrope_rows = [] if vision is None or "position_ids" not in vision else ["positions", "rope_deltas"]
    type_rows = [] if vision is None or "token_type_ids" not in vision else ["token_type_ids"]
    rows = {k: [] for k in mrope_rows + type_rows + [_TOKEN + k for k in features]}
    queries, responses, scores = [], [], []
    for m, s in enumerate(range(0, len(prompt_features), args.mini_batch_size)):
        rows_mb = slice(s, s + args.mini_batch_size)
        ids, mask = batch["input_ids"][rows_mb], batch["attention_mask"][rows_mb]
        shape = (len(ids), args.max_new_tokens, model.pretrained_model.config.vocab_size)
        q_noise = rollout_noise(args.seed, step, m, shape) if noise is None else noise[rows_mb]
        if vision is None:
            out = generate(model, ids, mask, q_noise, args, eos_token_ids, pad_token_id)
            q, r = trim_rollouts(ids, out, pad_token_id, eos_token_ids[0])
        else:
            v = {k: x[:, rows_mb] if k == "position_ids" else x[rows_mb] for k, x in vision.items()}
            out = generate(model, ids, mask, q_noise, args, eos_token_ids, pad_token_id, v)
            q, r = trim_rollouts(ids, out, pad_token_id, eos_token_ids[0], mask)
            for i, query in enumerate(q):
                start = ids.shape[1] - len(query)
                if mrope_rows:
                    rows["positions"].append(v["position_ids"][:, i, start:])
                    rows["rope_deltas"].append(int(v["rope_deltas"][i, 0]))
                if type_rows:
                    rows["token_type_ids"].append(v["token_type_ids"][i, start:])
                for k in features:
                    rows[_TOKEN + k].append(v[_TOKEN + k][i, start:])
        queries += q
        responses += r
        scores.append(get_rewards(reward_model, q, r, pad_token_id))
    if vision is None:
        return queries, responses, torch.cat(scores)
    return queries, responses, torch.cat(scores), {**rows, "text_features": _text_features(model,
                                                                                            _token_features(vision))}


def _padded_responses(responses, width: int) -> np.ndarray:
    out = np.full((len(responses), width), -1, np.int64)
    for i, r in enumerate(responses):
        out[i, :len(r)] = r.numpy()
    return out


def _run(model, reward_model, step_prompts, args: PPOArgs, eos_token_ids, pad_token_id: int, total_steps: int,
         mm: MultimodalContext | None = None):
    optimizer, scheduler = create_optimizer(model.named_parameters(), args, total_steps)
    kl_ctl = _kl_controller(args)
    step_stats, step_responses = {k: [] for k in STATS}, []
    for step, prompts in enumerate(step_prompts):
        queries, responses, scores, *vision = rollout(model, reward_model, prompts, args, eos_token_ids,
                                                      pad_token_id, step, mm=mm)
        stats = ppo_step(model, optimizer, scheduler, kl_ctl, queries, responses, scores, args, pad_token_id, step,
                         *vision)
        for k in STATS:
            step_stats[k].append(stats[k])
        step_responses.append(_padded_responses(responses, args.max_new_tokens))
    return step_stats, step_responses


def train_steps(model_dir, reward_model_dir, lora_init: dict, value_head_init: dict, step_prompts: list[list[dict]],
                args: PPOArgs, eos_token_ids, pad_token_id: int, tokenizer_dir=None, data_dir=None):
    """len(step_prompts) PPO steps (rollouts included) from the given adapter and value head (the schedule
    spans them all) -> (STATS per step, the cut responses per step, final adapter, final value head). A VL
    template's prompts need tokenizer_dir and data_dir (their images)."""
    model = load_policy(model_dir, args, lora_init, value_head_init)
    mm = None if tokenizer_dir is None else make_collator(args, tokenizer_dir, data_dir,
                                                          getattr(model.pretrained_model, "rope_index", None)).mm
    stats, responses = _run(model, load_reward_model(reward_model_dir), step_prompts, args, eos_token_ids,
                            pad_token_id, len(step_prompts), mm)
    return stats, responses, lora_state_dict(model.pretrained_model), value_head_state_dict(model)


@torch.no_grad()
def evaluate_reward(model, reward_model, features: list[dict], args: PPOArgs, eos_token_ids, pad_token_id: int,
                    mm: MultimodalContext | None = None) -> float:
    """The held-out score: eval_samples sampled responses per prompt (LF's generation settings, eval_noise:
    the same draws for every run), from prompts in batches of per_device_eval_batch_size, scored by the
    reward model -> the mean over every response."""
    size, scores = args.per_device_eval_batch_size, []
    eval_args = replace(args, per_device_train_batch_size=size)  # one generation mini-batch per eval batch
    vocab = model.pretrained_model.config.vocab_size
    for k in range(args.eval_samples):
        for b, s in enumerate(range(0, len(features), size)):
            prompts = features[s:s + size]
            noise = eval_noise(k, b, (len(prompts), args.max_new_tokens, vocab))
            scores.append(rollout(model, reward_model, prompts, eval_args, eos_token_ids, pad_token_id, 0, noise,
                                  mm)[2])
    return float(torch.cat(scores).double().mean())


def train_ppo(model_dir, tokenizer_dir, data_dir, reward_model_dir, args: PPOArgs = PPOArgs()) -> PPOResult:
    """End to end from data_dir/{train,eval}.json (alpaca rows: their prompts) to a trained adapter and value head."""
    start = time.perf_counter()
    train = load_prompt_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_prompt_dataset(tokenizer_dir, data_dir, "eval", args)
    eos_token_ids, pad_token_id = generation_ids(tokenizer_dir, args)
    model = load_policy(model_dir, args)  # lora_B = 0: the policy starts as the reference
    # M-RoPE models: LF's collator asks the model for positions
    mm = make_collator(args, tokenizer_dir, data_dir, getattr(model.pretrained_model, "rope_index", None)).mm
    reward_model = load_reward_model(reward_model_dir)
    eval_before = evaluate_reward(model, reward_model, held_out, args, eos_token_ids, pad_token_id, mm)
    step_prompts = [[train[i] for i in idx] for epoch in range(args.num_train_epochs)
                    for idx in prompt_batch_indices(len(train), args, epoch)]
    stats, responses = _run(model, reward_model, step_prompts, args, eos_token_ids, pad_token_id,
                            num_training_steps(len(train), args), mm)
    eval_after = evaluate_reward(model, reward_model, held_out, args, eos_token_ids, pad_token_id, mm)
    return PPOResult(stats, responses, eval_before, eval_after, lora_state_dict(model.pretrained_model),
                     value_head_state_dict(model), time.perf_counter() - start)
