"""LoRA PPO of Llama 3 as LLaMA-Factory runs it on TRL v0.9.6, in JAX/optax: twin of
torch_sources/training/ppo.py (read its docstring for the loop; the numpy draws are the same here).

Static shapes throughout. A step batch is bs prompts left-padded to one width P (the longest prompt of
the run); rollouts are generated in TRL's mini-batches (a lax.map over them: the rows are independent
but for longrope, whose table follows each forward's largest position), each a lax.scan over max_new_tokens that recomputes the forward on a fixed
[bs, P + max_new_tokens] buffer (a tiny model: no KV cache needed for a jitted, loop-free decode).
Queries and responses then live as right-padded model inputs [bs, W] plus per-row lengths, with LF's
trimming rule computed on device. One jitted, donated PPO step holds TRL's whole `step`: old and
reference passes, rewards, GAE (a reverse lax.scan), whitening, then ppo_epochs x mini-batches as a
lax.scan whose body accumulates GA mini-batch grads and applies clip + AdamW. The learning rate is the
PPO step's (the schedule steps once per PPO step, not per optimizer update), passed in as a scalar.

Vision-language policies (qwen2_vl and kin): the torch twin's docstring says why LF 0.9.5's own PPO cannot run
them and what its VL path is (LF's PPO with the multimodal collator's inputs passed where a VL model needs them;
the fake image kept out of the queries). Here the frozen tower runs once per image outside the jit (sft.
encode_images, a compile per image grid); its image features (sft.IMAGE_FEATURES: the merged patches, and
Qwen3-VL's DeepStack features) travel per token (`token_<keyword>` f32[B,T,...], read at the image tokens: a
generated image-pad token reads the token's text embedding and no DeepStack), with the prompt's M-RoPE positions
[B,3,P] and rope deltas [B]. Generation keeps its lax.scan on the fixed buffer, positions [3,B,P+N] (the prompt's,
then each new token's text position + the row's delta); the rollout batch carries row_positions i32[B,3,W] (the
query's, then text continuing: the rope index of query + response) and the per-token features f32[B,W,...], per
row, so the step's mini-batch permutations take them along. The reward model scores the ids as before. Qwen2.5-Omni's
thinker: LF's fake audio in every prompt batch goes through the frozen audio tower outside the jit too (sft.
encode_audio) and travels per token (token_audio_embeds, read at the audio tokens); the prompt's rope deltas are
taken against the text positions, and a sampled video token is text (the torch twin's docstring). The fixed-size
towers (gemma3, paligemma, llava_next, internvl): their rows (sft.encode_images, one compile per image shape, or
per LLaVA-NeXT image size) travel per token the same way, with no M-RoPE: generation at text positions, Gemma 3's
and PaliGemma's token types [B,P] on the buffer (new tokens the prompt's last type) and no positions (their
forwards take none: the torch twin's docstring); the rollout batch carries their token_type_ids i32[B,W] (the
query's, then that type over the response, pads 0) and no positions (TRL's forward: the model's own).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file

from ..models.layers import padded_positions
from .collator import PromptDataCollator
from .lora import init_lora_tree, lora_state_dict, lora_tree_from_state_dict
from .optimizer import LR_MULTIPLIERS, _decay_mask, clip_grad_norm, get_warmup_steps
from .processor import preprocess_unsupervised_dataset
from .collator import MultimodalContext
from .sft import (AUDIO_FEATURES, IMAGE_FEATURES, CausalLM, TrainArgs, _fake_media_length, _fixed_tokenizer,
                  encode_audio, encode_images, load_model, lora_config, media_dir, multimodal_context)

__all__ = ["PPOArgs", "PPOResult", "STATS", "VALUE_HEAD_FILE", "load_prompt_dataset", "make_collator",
           "prompt_batch_indices", "num_training_steps", "init_value_head", "value_head",
           "CausalLMWithValueHead", "load_policy", "load_reward_model", "value_head_state_dict",
           "load_value_head_state_dict", "generation_ids", "rollout_noise", "eval_noise", "warp_logits", "sample_next_tokens",
           "prompt_vision", "generate", "trim_rollouts", "prepare_model_inputs", "get_rewards", "logprobs_from_logits",
           "batched_forward_pass", "masked_mean", "masked_var", "masked_whiten", "compute_rewards",
           "compute_advantages", "ppo_loss", "AdaptiveKLController", "FixedKLController", "ppo_step",
           "ppo_step_loss_and_grads", "rollout", "train_steps", "evaluate_reward", "train_ppo"]

VALUE_HEAD_FILE = "value_head.safetensors"
_VALUE_HEAD, _ROLLOUT, _MINIBATCH, _EVAL = 1, 2, 3, 4

STATS = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy", "ppo/policy/approxkl",
         "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages_mean", "ppo/returns/mean",
         "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var",
         "ppo/val/var_explained", "objective/kl", "objective/kl_coef", "objective/entropy",
         "ppo/mean_non_score_reward", "ppo/mean_scores", "ppo/std_scores")


@dataclass(frozen=True)
class PPOArgs(TrainArgs):
    """TrainArgs plus LF's ppo_* arguments, TRL PPOConfig defaults and LF's generating arguments."""

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
    eval_samples: int = 4

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
    def batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.ppo_buffer_size


@dataclass(frozen=True)
class PPOResult:
    step_stats: dict[str, list[float]]
    step_responses: list[np.ndarray]
    eval_before: float
    eval_after: float
    lora_state_dict: dict[str, np.ndarray]
    value_head: dict[str, np.ndarray]
    wall_clock_s: float


# ---- data --------------------------------------------------------------------------------------

def load_prompt_dataset(tokenizer_dir, data_dir, split: str, args: PPOArgs) -> list[dict]:
    """data_dir/{split}.json (alpaca rows, with `images` for a VL template) through the unsupervised processor."""
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    rows = json.loads((Path(data_dir) / f"{split}.json").read_text())
    return preprocess_unsupervised_dataset(rows, tokenizer, template, args.cutoff_len, media_dir(args, data_dir))


def make_collator(args: PPOArgs, tokenizer_dir=None, pad_to_length: int | None = None, data_dir=None,
                  rope_index=None) -> PromptDataCollator:
    """The prompt collator; a VL template's also reads the rows' images and takes the model's rope_index."""
    if tokenizer_dir is None:
        return PromptDataCollator(pad_token_id=0, pad_to_length=pad_to_length)
    return PromptDataCollator(pad_token_id=_fixed_tokenizer(tokenizer_dir, args)[1].pad_token_id,
                              pad_to_length=pad_to_length,
                              mm=multimodal_context(args, tokenizer_dir, data_dir, rope_index))


def generation_ids(tokenizer_dir, args: PPOArgs) -> tuple[tuple[int, ...], int]:
    template, tokenizer = _fixed_tokenizer(tokenizer_dir, args)
    eos = [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(w) for w in template.stop_words[1:]]
    return tuple(dict.fromkeys(eos)), tokenizer.pad_token_id


def prompt_batch_indices(num_examples: int, args: PPOArgs, epoch: int) -> list[np.ndarray]:
    order = np.random.default_rng(args.seed + epoch).permutation(num_examples)
    return [order[s:s + args.batch_size] for s in range(0, num_examples - args.batch_size + 1, args.batch_size)]


def num_training_steps(num_examples: int, args: PPOArgs) -> int:
    return args.num_train_epochs * math.ceil(num_examples / args.batch_size)


# ---- the value head and the two models ------------------------------------------------------

def init_value_head(hidden_size: int, seed: int) -> dict[str, np.ndarray]:
    """The same numpy draws as the torch twin (nn.Linear's default distribution), torch names and layout."""
    bound = 1.0 / math.sqrt(hidden_size)
    rng = np.random.default_rng([seed, _VALUE_HEAD])
    return {"v_head.summary.weight": rng.uniform(-bound, bound, (1, hidden_size)).astype(np.float32),
            "v_head.summary.bias": rng.uniform(-bound, bound, (1,)).astype(np.float32)}


def value_head(hidden, weight, bias):
    """f32[..., D] x f32[1, D] + f32[1] -> f32[...]."""
    return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), weight[0]) + bias[0]


def load_value_head_state_dict(state_dict: dict) -> dict:
    """{"v_head.summary.weight", "v_head.summary.bias"} -> the value-head tree {"summary": {"weight": f32[1, D],
    "bias": f32[1]}} (torch layout)."""
    expected = {"v_head.summary.weight", "v_head.summary.bias"}
    if set(state_dict) != expected:
        raise KeyError(f"value head names differ: expected {sorted(expected)}, got {sorted(state_dict)}")
    return {"summary": {k: jnp.asarray(np.asarray(state_dict[f"v_head.summary.{k}"], np.float32))
                        for k in ("weight", "bias")}}


def value_head_state_dict(tree: dict) -> dict[str, np.ndarray]:
    return {f"v_head.summary.{k}": np.array(tree["summary"][k], np.float32) for k in ("weight", "bias")}


@dataclass(frozen=True)
class CausalLMWithValueHead:
    """A Linen causal LM and its base params; apply -> (fp32 logits, values) with an adapter (or None: the
    reference / a full model) and a value-head tree."""

    module: object
    params: dict

    def apply(self, lora, v_head, input_ids, attention_mask, position_ids=None, **inputs):
        return _forward(self.module, self.params, lora, v_head, input_ids, attention_mask, position_ids, **inputs)


def _forward(module, params, lora, v_head, input_ids, attention_mask, position_ids=None, **inputs):
    """inputs: a VL model's keywords (the tower's sft.IMAGE_FEATURES, Omni's sft.AUDIO_FEATURES, indexed by token;
    Gemma 3's and PaliGemma's token_type_ids). position_ids only when given: Gemma 3's and PaliGemma's forwards
    take none (their own 0..T-1 / 1..T)."""
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    positions = {} if position_ids is None else {"position_ids": position_ids}
    logits, hidden = module.apply(variables, input_ids, attention_mask, return_hidden=True, **positions, **inputs)
    return logits.astype(jnp.float32), value_head(hidden, v_head["summary"]["weight"], v_head["summary"]["bias"])


def load_policy(model_dir, args: PPOArgs, lora_init: dict | None = None,
                value_head_init: dict | None = None) -> tuple[CausalLMWithValueHead, dict]:
    """(the policy, its trainable tree {"lora", "v_head"}) from args.seed's inits or the given state dicts."""
    model: CausalLM = load_model(model_dir, lora_config(args))
    lora = (init_lora_tree(model.params, lora_config(args), args.seed) if lora_init is None
            else lora_tree_from_state_dict(lora_init))
    hidden = model.module.config.hidden_size
    v_head = load_value_head_state_dict(value_head_init or init_value_head(hidden, args.seed))
    return CausalLMWithValueHead(model.module, model.params), {"lora": lora, "v_head": v_head}


def load_reward_model(reward_model_dir) -> tuple[CausalLMWithValueHead, dict]:
    """LF's full reward model: (the checkpoint, its value head from value_head.safetensors)."""
    path = Path(reward_model_dir) / VALUE_HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: a full reward model needs its value head (LF load_valuehead_params)")
    model = load_model(reward_model_dir)
    return CausalLMWithValueHead(model.module, model.params), load_value_head_state_dict(load_file(str(path)))


# ---- rollouts ------------------------------------------------------------------------------------

def rollout_noise(seed: int, step: int, batch_index: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([seed, _ROLLOUT, step, batch_index]).exponential(size=shape).astype(np.float32)


def eval_noise(sample: int, batch_index: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([_EVAL, sample, batch_index]).exponential(size=shape).astype(np.float32)


def warp_logits(logits, args: PPOArgs):
    """Temperature, top-k (ties at the k-th kept), top-p (the cumulative mass of the ascending sort above
    1 - top_p is kept, the top token always); removed tokens get -inf."""
    scores = logits.astype(jnp.float32) / args.temperature
    if 0 < args.top_k < scores.shape[-1]:
        kth = jax.lax.top_k(scores, args.top_k)[0][..., -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if args.top_p < 1.0:
        order = jnp.argsort(scores, axis=-1)
        sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_scores, axis=-1), axis=-1)
        remove = (cumulative <= 1 - args.top_p).at[..., -1].set(False)
        remove = jnp.take_along_axis(remove, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        scores = jnp.where(remove, -jnp.inf, scores)
    return scores


def sample_next_tokens(logits, noise, args: PPOArgs):
    """f32[B,V], f32[B,V] Exp(1) -> i32[B]: the exponential race over the warped distribution."""
    return jnp.argmax(jax.nn.softmax(warp_logits(logits, args), axis=-1) / noise, axis=-1).astype(jnp.int32)


_TOKEN = "token_"  # a VL batch's per-token tower features: token_<keyword> f32[B,T,...] (sft.IMAGE_FEATURES, and
# Omni's sft.AUDIO_FEATURES: read at the audio tokens)


def _token_features(inputs: dict) -> dict:  # -> {keyword: f32[B,T,...]}
    return {k: inputs[_TOKEN + k] for k in IMAGE_FEATURES + AUDIO_FEATURES if _TOKEN + k in inputs}


def _feature_token(config, keyword: str) -> int:
    """The token a keyword's rows replace: the image-pad token's, Omni's audio rows the audio token's."""
    return config.audio_token_id if keyword in AUDIO_FEATURES else config.image_token_id


def _text_features(module, params, features: dict) -> dict:  # {keyword: f32[B,T,...]} -> {keyword: f32[...]}
    """What a generated image-pad (or audio) token carries: it is text (as generate's decode steps embed it), so
    its merged patch (its audio row) is the token's own text embedding and an added feature (DeepStack's) is zero
    (x + 0 = x)."""
    def text(token_id):
        return module.apply({"params": params}, jnp.full((1, 1), token_id, jnp.int32), method="embed")[0, 0]
    return {k: text(module.config.image_token_id) if k == "image_embeds"
            else text(module.config.audio_token_id) if k in AUDIO_FEATURES else jnp.zeros(v.shape[2:], v.dtype)
            for k, v in features.items()}


def _image_inputs(module, input_ids, features: dict) -> dict:  # i32[B,T], {k: f32[B,T,...]} -> {k: f32[B*T,...]}
    """The forward's tower keywords: row k = the features at the k-th image (Omni's audio rows: audio) token in
    reading order (the rows past the tokens' count are never read); Omni's thinker also takes a sampled video
    token as text (video_tokens_as_text), as generate's decode steps embed it."""
    out = {}
    for k, v in features.items():
        flat = (input_ids == _feature_token(module.config, k)).reshape(-1)
        (where,) = jnp.nonzero(flat, size=flat.shape[0], fill_value=0)
        out[k] = v.reshape(flat.shape[0], *v.shape[2:])[where]
    if any(k in AUDIO_FEATURES for k in out):  # Omni's thinker: a sampled video token is text (positions given)
        out["video_tokens_as_text"] = True
    return out


def prompt_vision(policy: CausalLMWithValueHead, batch: dict) -> dict | None:
    """A collated VL prompt batch -> {positions i32[B,3,P], rope_deltas i32[B], token_<keyword> f32[B,P,...]: the
    frozen tower's image features at the image tokens (encode_images, outside the jit), 0 elsewhere}; None for
    text. An Omni batch (LF's fake audio) adds the audio tower's rows at its (masked) audio tokens
    (token_audio_embeds, encode_audio outside the jit) and takes its rope deltas against the text positions: the
    largest position + 1 - the attended tokens (LF's Omni branch hands them against the absolute column, at LF's
    width; the torch twin's _text_deltas). A fixed-size tower's batch (no grids) has no M-RoPE: {token_image_embeds,
    and Gemma 3's and PaliGemma's token_type_ids i32[B,P] (the collator's, left-padded with 0)}."""
    if "pixel_values" not in batch:
        return None
    features = encode_images(policy, batch["pixel_values"], batch.get("image_grid_thw"), batch.get("image_sizes"))
    if "input_features" in batch:
        features["audio_embeds"] = encode_audio(policy, batch["input_features"], batch["feature_attention_mask"])
    ids = np.asarray(batch["input_ids"])
    per_token = {}
    for k, rows in features.items():
        per_token[_TOKEN + k] = np.zeros((*ids.shape, *rows.shape[1:]), np.float32)
        per_token[_TOKEN + k][ids == _feature_token(policy.module.config, k)] = rows
    if "image_grid_thw" not in batch:  # a fixed-size tower: text positions
        types = {"token_type_ids": np.asarray(batch["token_type_ids"], np.int32)} if "token_type_ids" in batch else {}
        return {**per_token, **types}
    positions = np.asarray(batch["position_ids"], np.int32)
    if "input_features" in batch:
        deltas = positions.max(axis=(0, 2)) + 1 - np.asarray(batch["attention_mask"]).sum(-1)
    else:
        deltas = np.asarray(batch["rope_deltas"])[:, 0]
    return {"positions": positions.transpose(1, 0, 2), "rope_deltas": deltas.astype(np.int32), **per_token}


def _generate(module, args, eos_token_ids, pad_token_id, params, lora, input_ids, attention_mask, noise, vision=None):
    """lax.scan over max_new_tokens on the fixed buffer [B, P + N]; see `generate`."""
    B, P = input_ids.shape
    N = args.max_new_tokens
    ids = jnp.concatenate([input_ids, jnp.full((B, N), pad_token_id, jnp.int32)], axis=1)
    mask = jnp.concatenate([attention_mask, jnp.zeros((B, N), jnp.int32)], axis=1)
    eos = jnp.asarray(eos_token_ids, jnp.int32)
    variables = {"params": params, "lora": lora}
    if vision is not None:  # new tokens carry the image-pad token's text features (only an image-pad token reads them)
        features = _token_features(vision)
        text = _text_features(module, params, features)
        features = {k: jnp.concatenate([v, jnp.broadcast_to(text[k], (B, N, *text[k].shape))], axis=1)
                    for k, v in features.items()}
        if "token_type_ids" in vision:  # Gemma 3, PaliGemma: new tokens take the prompt's last type (HF's rule)
            types = vision["token_type_ids"]
            types = jnp.concatenate([types, jnp.broadcast_to(types[:, -1:], (B, N))], axis=1)

    def forward(ids, mask):
        text_positions = jnp.where(mask == 0, 1, jnp.cumsum(mask, axis=-1) - 1)
        if vision is None:
            return module.apply(variables, ids, mask, position_ids=text_positions)
        inputs = _image_inputs(module, ids, features)
        if "positions" in vision:
            decode = jnp.where(mask == 0, 0, jnp.cumsum(mask, axis=-1) - 1) + vision["rope_deltas"][:, None]
            inputs["position_ids"] = jnp.concatenate([jnp.transpose(vision["positions"], (1, 0, 2)),
                                                      jnp.broadcast_to(decode[None, :, P:], (3, B, N))], axis=2)
        elif "token_type_ids" in vision:  # their forwards take no positions (the torch twin's _tower_inputs)
            inputs["token_type_ids"] = types
        else:
            inputs["position_ids"] = text_positions
        return module.apply(variables, ids, mask, **inputs)

    def body(carry, t):
        ids, mask, finished = carry
        logits = forward(ids, mask)
        last = jax.lax.dynamic_index_in_dim(logits, P + t - 1, axis=1, keepdims=False).astype(jnp.float32)
        token = sample_next_tokens(last, noise[:, t], args)
        token = jnp.where(finished, pad_token_id, token)
        finished = finished | jnp.isin(token, eos)
        ids = jax.lax.dynamic_update_index_in_dim(ids, token, P + t, axis=1)
        mask = jax.lax.dynamic_update_index_in_dim(mask, jnp.ones((B,), jnp.int32), P + t, axis=1)
        return (ids, mask, finished), token

    _, tokens = jax.lax.scan(body, (ids, mask, jnp.zeros((B,), jnp.bool_)), jnp.arange(N))
    return tokens.T


def _generate_by_mini_batch(module, args, eos_token_ids, pad_token_id, params, lora, input_ids, attention_mask, noise,
                            vision=None):
    """TRL generates mini_batch_size rows at a time. The rows are independent for every RoPE but longrope,
    whose table follows the largest position of each forward: so the rows are generated in torch's groups
    (one lax.map over equal groups; a smaller last group, as torch's, in its own call). vision: per row."""
    B, mb = input_ids.shape[0], args.mini_batch_size
    gen = functools.partial(_generate, module, args, eos_token_ids, pad_token_id, params, lora)
    rows = (input_ids, attention_mask, noise, vision)
    if mb >= B:
        return gen(*rows)
    full = B - B % mb
    groups = jax.tree.map(lambda x: x[:full].reshape(full // mb, mb, *x.shape[1:]), rows)
    tokens = jax.lax.map(lambda g: gen(*g), groups)
    tokens = tokens.reshape(full, -1)
    if full < B:
        tokens = jnp.concatenate([tokens, gen(*jax.tree.map(lambda x: x[full:], rows))])
    return tokens


@functools.lru_cache(maxsize=None)
def _generate_fn(module, args, eos_token_ids, pad_token_id):
    return jax.jit(functools.partial(_generate, module, args, eos_token_ids, pad_token_id))


def generate(policy: CausalLMWithValueHead, lora, input_ids, attention_mask, noise, args: PPOArgs,
             eos_token_ids, pad_token_id: int, vision: dict | None = None):
    """HF generate (do_sample, the exponential race over noise f32[B, N, V]) from left-padded prompts i32[B,P]
    -> i32[B, max_new_tokens], pad after a row's eos; positions are the mask cumsum - 1 (1 on pads). vision
    (prompt_vision's): the prompt's image embeddings and M-RoPE positions, new tokens at text position + delta; a
    fixed-size tower's image rows at text positions, Gemma 3's and PaliGemma's token types (new tokens the prompt's
    last type; no positions: the torch twin's _tower_inputs)."""
    fn = _generate_fn(policy.module, args, tuple(int(e) for e in eos_token_ids), int(pad_token_id))
    return fn(policy.params, lora, jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32),
              jnp.asarray(noise), None if vision is None else {k: jnp.asarray(v) for k, v in vision.items()})


def _rollout_lengths(query_ids, response_ids, pad_token_id: int, eos_token_id: int, attention_mask=None):
    """LF's trimming rule as lengths: (query start i32[B], query length, response length). attention_mask (a VL
    batch's): each query starts at its first attended token (LF's fake image stays out)."""
    P, N = query_ids.shape[1], response_ids.shape[1]
    start = jnp.argmax((query_ids != pad_token_id) if attention_mask is None else (attention_mask != 0), axis=-1)
    kept = response_ids != pad_token_id
    last = N - 1 - jnp.argmax(kept[:, ::-1], axis=-1)
    extra = 2 if eos_token_id == pad_token_id else 1
    length = jnp.where(kept.any(axis=-1), jnp.minimum(last + extra, N), 1)
    return start, P - start, length


def trim_rollouts(query_ids, response_ids, pad_token_id: int, eos_token_id: int):
    """LF get_inputs' trimming on host -> (queries, responses) as lists of int arrays (the torch twin's form)."""
    q, r = np.asarray(query_ids), np.asarray(response_ids)
    start, _, length = (np.asarray(x) for x in _rollout_lengths(jnp.asarray(q), jnp.asarray(r), pad_token_id,
                                                                 eos_token_id))
    return [q[i, start[i]:] for i in range(len(q))], [r[i, :length[i]] for i in range(len(r))]


def _model_inputs(query_ids, start, query_len, response_ids, response_len, pad_token_id: int):
    """Right-padded query + response [B, P + N] and its attention mask, gathered on device."""
    B, P = query_ids.shape
    W = P + response_ids.shape[1]
    j = jnp.arange(W)[None]
    from_query = jnp.take_along_axis(query_ids, jnp.clip(start[:, None] + j, 0, P - 1), axis=1)
    from_response = jnp.take_along_axis(response_ids, jnp.clip(j - query_len[:, None], 0, W - 1 - P), axis=1)
    total = (query_len + response_len)[:, None]
    ids = jnp.where(j < query_len[:, None], from_query, jnp.where(j < total, from_response, pad_token_id))
    return {"input_ids": ids.astype(jnp.int32), "attention_mask": (j < total).astype(jnp.int32)}


def _vision_inputs(vision, start, query_len, response_len, width: int, text_features: dict):
    """A VL rollout batch's per-row inputs of query + response [B, width]: the per-token image features
    f32[B,W,...] (the query's; the image-pad token's text features past it), Qwen-VL's row_positions i32[B,3,W]
    (the query's prompt positions, then text: column j at j + delta; pads 0), Gemma 3's and PaliGemma's
    token_type_ids i32[B,W] (the query's, then its last type over the response; pads 0)."""
    j = jnp.arange(width)[None]
    in_query, in_row = j < query_len[:, None], j < (query_len + response_len)[:, None]

    def from_query(v):  # [B,P,...] -> [B,W,...]: the query's columns (start + j), clipped past the prompt
        src = jnp.clip(start[:, None] + j, 0, v.shape[1] - 1)
        return jnp.take_along_axis(v, src.reshape(*src.shape, *(1,) * (v.ndim - 2)), axis=1)

    def per_token(v, text_feature):  # f32[B,P,...] -> f32[B,W,...]
        trailing = (1,) * (v.ndim - 2)  # the feature's own axes, broadcast
        return jnp.where(in_query.reshape(*in_query.shape, *trailing), from_query(v), text_feature)

    out = {_TOKEN + k: per_token(v, text_features[k]) for k, v in _token_features(vision).items()}
    if "positions" in vision:
        P = vision["positions"].shape[2]
        src = jnp.clip(start[:, None] + j, 0, P - 1)
        query_positions = jnp.take_along_axis(vision["positions"], src[:, None, :], axis=2)
        text = jnp.where(in_row, j + vision["rope_deltas"][:, None], 0)
        out["row_positions"] = jnp.where(in_query[:, None], query_positions, text[:, None]).astype(jnp.int32)
    if "token_type_ids" in vision:
        types = vision["token_type_ids"]
        out["token_type_ids"] = jnp.where(in_query, from_query(types),
                                          jnp.where(in_row, types[:, -1:], 0)).astype(jnp.int32)
    return out


def prepare_model_inputs(queries, responses, pad_token_id: int, width: int | None = None) -> dict[str, np.ndarray]:
    """Host twin of TRL's prepare_model_inputs: query + response right-padded (to `width`, or the longest)."""
    rows = [np.concatenate([np.asarray(q), np.asarray(r)]) for q, r in zip(queries, responses)]
    width = width or max(len(x) for x in rows)
    ids, mask = np.full((len(rows), width), pad_token_id, np.int32), np.zeros((len(rows), width), np.int32)
    for i, x in enumerate(rows):
        ids[i, :len(x)], mask[i, :len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask}


def _scores(reward: CausalLMWithValueHead, reward_v_head, model_inputs):
    _, values = _forward(reward.module, reward.params, None, reward_v_head, model_inputs["input_ids"],
                         model_inputs["attention_mask"])
    last = jnp.sum(model_inputs["attention_mask"], axis=-1) - 1
    return jnp.take_along_axis(values, last[:, None], axis=-1)[:, 0]


@functools.lru_cache(maxsize=None)
def _scores_fn(module):
    return jax.jit(lambda params, v_head, inputs: _scores(CausalLMWithValueHead(module, params), v_head, inputs))


def get_rewards(reward_model, reward_v_head, model_inputs: dict):
    """The reward model's value at attention_mask.sum - 1 of right-padded query + response -> f32[B]."""
    return _scores_fn(reward_model.module)(reward_model.params, reward_v_head,
                                           {k: jnp.asarray(v, jnp.int32) for k, v in model_inputs.items()})


# ---- TRL's step (pure jnp) -----------------------------------------------------------------------

def logprobs_from_logits(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.sum(logp * jax.nn.one_hot(labels, logp.shape[-1], dtype=logp.dtype), axis=-1)


def _response_masks(attention_mask, query_len, response_len):
    """TRL/LF's masks[:, :-1]: 1 at positions t in [q - 1, q - 1 + r) (they predict the response tokens)."""
    t = jnp.arange(attention_mask.shape[1] - 1)[None]
    start = (query_len - 1)[:, None]
    inside = (t >= start) & (t < start + response_len[:, None])
    return (inside & (attention_mask[:, 1:] > 0)).astype(jnp.float32)


def batched_forward_pass(policy: CausalLMWithValueHead, lora, v_head, model_inputs: dict, query_len, response_len,
                         return_logits: bool = False):
    """(logprobs f32[B,W-1], logits f32[B,W-1,V] or None, values f32[B,W-1], masks f32[B,W-1]) of right-padded
    inputs; lora None = the reference (adapter disabled)."""
    ids, mask = model_inputs["input_ids"], model_inputs["attention_mask"]
    # a VL batch: its image features, Qwen-VL's M-RoPE positions, Gemma 3's and PaliGemma's token types
    inputs = _image_inputs(policy.module, ids, _token_features(model_inputs))
    if "row_positions" in model_inputs:
        inputs["position_ids"] = jnp.transpose(model_inputs["row_positions"], (1, 0, 2))
    elif "position_ids" in model_inputs:
        inputs["position_ids"] = model_inputs["position_ids"]
    if "token_type_ids" in model_inputs:
        inputs["token_type_ids"] = model_inputs["token_type_ids"]
    logits, values = policy.apply(lora, v_head, ids, mask, **inputs)
    logprobs = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    return (logprobs, logits[:, :-1] if return_logits else None, values[:, :-1],
            _response_masks(mask, query_len, response_len))


def masked_mean(values, mask, axis=None):
    return jnp.sum(values * mask, axis=axis) / jnp.sum(mask, axis=axis)


def masked_var(values, mask):
    """TRL's unbiased masked variance (the only form its PPO uses): times n / (n - 1), n = mask.sum()."""
    n = jnp.sum(mask)
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * (n / (n - 1))


def masked_whiten(values, mask, shift_mean: bool = True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef):
    """(rewards, non-score rewards, kls) f32[B,T]: -kl_coef (logp - ref logp), the score at the last masked t."""
    kls = logprobs - ref_logprobs
    non_score = -kl_coef * kls
    T = masks.shape[1]
    last = T - 1 - jnp.argmax(masks[:, ::-1] > 0, axis=-1)
    return non_score + scores[:, None] * jax.nn.one_hot(last, T, dtype=non_score.dtype), non_score, kls


def compute_advantages(values, rewards, mask, gamma: float, lam: float, whiten_rewards: bool = False,
                       width=None):
    """GAE as a reverse lax.scan over positions -> (masked values, whitened advantages, returns).

    width: how many positions the batch has in torch (the step's static buffer is wider). Whitened rewards
    are nonzero at masked positions too and GAE carries them backwards, so positions past `width`, which
    TRL's batch does not have, must carry none."""
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
        if width is not None:
            rewards = rewards * (jnp.arange(rewards.shape[-1]) < width)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def body(lastgaelam, delta):
        lastgaelam = delta + gamma * lam * lastgaelam
        return lastgaelam, lastgaelam

    _, advantages = jax.lax.scan(body, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    advantages = advantages.T
    returns = advantages + values
    return values, jax.lax.stop_gradient(masked_whiten(advantages, mask)), returns


def _entropy_from_logits(logits):
    pd = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(pd * logits, axis=-1)


def ppo_loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, args: PPOArgs):
    """TRL PPOTrainer.loss -> (policy loss, vf_coef x value loss, stats); zeroed past ratio_threshold."""
    vpredclipped = jnp.clip(vpreds, values - args.cliprange_value, values + args.cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(jnp.maximum(vf_losses1, vf_losses2), mask)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).astype(jnp.float32), mask)
    ratio = jnp.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
    pg_loss = masked_mean(jnp.maximum(pg_losses, pg_losses2), mask)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses).astype(jnp.float32), mask)
    keep = (jax.lax.stop_gradient(masked_mean(ratio, mask)) <= args.ratio_threshold).astype(jnp.float32)
    pg_loss, vf_loss = pg_loss * keep, vf_loss * keep
    loss = pg_loss + args.vf_coef * vf_loss
    stats = {"loss/policy": pg_loss, "loss/value": vf_loss, "loss/total": loss,
             "policy/entropy": masked_mean(_entropy_from_logits(logits), mask),
             "policy/approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
             "policy/policykl": masked_mean(old_logprobs - logprobs, mask), "policy/clipfrac": pg_clipfrac,
             "policy/advantages_mean": masked_mean(advantages, mask),
             "returns/mean": masked_mean(returns, mask), "returns/var": masked_var(returns, mask),
             "val/vpred": masked_mean(vpreds, mask), "val/error": masked_mean((vpreds - returns) ** 2, mask),
             "val/clipfrac": vf_clipfrac, "val/mean": masked_mean(values, mask), "val/var": masked_var(values, mask)}
    return pg_loss, args.vf_coef * vf_loss, jax.tree.map(jax.lax.stop_gradient, stats)


class AdaptiveKLController:
    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current, n_steps: int):
        proportional_error = jnp.clip(current / self.target - 1, -0.2, 0.2)
        self.value = self.value * (1 + proportional_error * n_steps / self.horizon)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current, n_steps: int):
        pass


def _next_kl_coef(args: PPOArgs, kl_coef, mean_kl):
    ctl = (AdaptiveKLController(kl_coef, args.ppo_target, args.horizon) if args.adap_kl_ctrl
           else FixedKLController(kl_coef))
    ctl.update(mean_kl, args.batch_size)
    return ctl.value


def _step_batch(policy, args, lora, v_head, batch, kl_coef):
    """The no-grad half of the step on a rollout batch {input_ids, attention_mask, query_len, response_len,
    scores} -> every per-token tensor TRL keeps. Every forward of the step (here and in the mini-batches)
    sees torch's positions: its rows are right-padded to the longest of the whole batch."""
    if not _token_features(batch):  # a VL batch brings its M-RoPE positions, or a fixed-size tower runs at its own
        batch = {**batch, "position_ids": padded_positions(batch["attention_mask"],
                                                           jnp.max(batch["query_len"] + batch["response_len"]))}
    logprobs, _, values, masks = batched_forward_pass(policy, lora, v_head, batch, batch["query_len"],
                                                      batch["response_len"])
    ref_logprobs, _, _, _ = batched_forward_pass(policy, None, v_head, batch, batch["query_len"],
                                                 batch["response_len"])
    rewards, non_score, kls = compute_rewards(batch["scores"], logprobs, ref_logprobs, masks, kl_coef)
    width = jnp.max(batch["query_len"] + batch["response_len"]) - 1  # torch's right-padded rows, shifted
    values, advantages, returns = compute_advantages(values, rewards, masks, args.gamma, args.lam,
                                                     args.ppo_whiten_rewards, width)
    out = {"logprobs": logprobs, "ref_logprobs": ref_logprobs, "values": values, "masks": masks,
           "advantages": advantages, "returns": returns, "kls": kls, "non_score_reward": non_score}
    return jax.tree.map(jax.lax.stop_gradient, {**batch, **out})


def _minibatch_loss(policy, args, trainable, mb):
    logprobs, logits, vpreds, _ = batched_forward_pass(policy, trainable["lora"], trainable["v_head"], mb,
                                                       mb["query_len"], mb["response_len"], return_logits=True)
    loss_p, loss_v, stats = ppo_loss(mb["logprobs"], mb["values"], logits, vpreds, logprobs, mb["masks"],
                                     mb["advantages"], mb["returns"], args)
    return loss_p + loss_v, stats


def _adam(args: PPOArgs):
    """clip + AdamW without its learning rate: the caller scales by -lr of the PPO step."""
    chain = [optax.scale_by_adam(b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon),
             optax.add_decayed_weights(args.weight_decay, mask=_decay_mask)]
    if args.max_grad_norm > 0:
        chain.insert(0, clip_grad_norm(args.max_grad_norm))
    return optax.chain(*chain)


def _ppo_step(module, args, params, trainable, opt_state, kl_coef, lr, batch, perms):
    """TRL's step. perms: i32[ppo_epochs, bs] mini-batch orders -> (trainable, opt_state, next kl_coef, stats)."""
    policy, tx = CausalLMWithValueHead(module, params), _adam(args)
    data = _step_batch(policy, args, trainable["lora"], trainable["v_head"], batch, kl_coef)
    bs, mb, GA = perms.shape[1], args.mini_batch_size, args.gradient_accumulation_steps
    groups = perms.reshape(-1, GA, mb)  # [epochs x backward batches, GA, mb]
    per_row = {k: v for k, v in data.items() if jnp.ndim(v) >= 1 and v.shape[0] == bs}

    def update(carry, group):
        trainable, opt_state = carry

        def micro(grads, idx):
            mbatch = {k: v[idx] for k, v in per_row.items()}
            (_, stats), g = jax.value_and_grad(lambda t: _minibatch_loss(policy, args, t, mbatch), has_aux=True)(
                trainable)
            return jax.tree.map(lambda a, b: a + b / GA, grads, g), stats

        grads, stats = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, trainable), group)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = jax.tree.map(lambda p, u: p - lr * u, trainable, updates)
        return (trainable, opt_state), stats

    (trainable, opt_state), stats = jax.lax.scan(update, (trainable, opt_state), groups)
    stats = {f"ppo/{k}": jnp.mean(v) for k, v in stats.items()}
    stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    mask = data["masks"]
    mean_kl = jnp.mean(jnp.sum(data["kls"] * mask, axis=-1))
    scores = data["scores"]
    stats.update({"objective/kl": mean_kl, "objective/kl_coef": jnp.asarray(kl_coef, jnp.float32),
                  "objective/entropy": jnp.mean(jnp.sum(-data["logprobs"] * mask, axis=-1)),
                  "ppo/mean_non_score_reward": masked_mean(data["non_score_reward"], mask),
                  "ppo/mean_scores": jnp.mean(scores), "ppo/std_scores": jnp.std(scores, ddof=1)})
    return trainable, opt_state, _next_kl_coef(args, kl_coef, mean_kl), {k: stats[k] for k in STATS}


@functools.lru_cache(maxsize=None)
def _ppo_step_fn(module, args):
    return jax.jit(functools.partial(_ppo_step, module, args), donate_argnums=(1, 2))


def _learning_rate(args: PPOArgs, step: int, total_steps: int) -> float:
    warmup = get_warmup_steps(total_steps, args.warmup_ratio)
    return args.learning_rate * float(LR_MULTIPLIERS[args.lr_scheduler_type](step, warmup, total_steps))


def _minibatch_orders(args: PPOArgs, step: int, bs: int) -> np.ndarray:
    rng = np.random.default_rng([args.seed, _MINIBATCH, step])
    return np.stack([rng.permutation(bs) for _ in range(args.ppo_epochs)]).astype(np.int32)


def ppo_step(policy, trainable, opt_state, kl_coef, batch: dict, args: PPOArgs, step: int, total_steps: int):
    """One TRL step on a rollout batch (see `rollout`) -> (trainable, opt_state, next kl_coef, STATS on device).
    trainable and opt_state are donated."""
    return _ppo_step_fn(policy.module, args)(policy.params, trainable, opt_state, kl_coef, _learning_rate(args, step, total_steps), batch,
                                      jnp.asarray(_minibatch_orders(args, step, batch["input_ids"].shape[0])))


def _first_minibatch(module, args, params, trainable, kl_coef, batch):
    policy = CausalLMWithValueHead(module, params)
    data = _step_batch(policy, args, trainable["lora"], trainable["v_head"], batch, kl_coef)
    mbatch = {k: v[:args.mini_batch_size] for k, v in data.items() if jnp.ndim(v) >= 1}
    (_, stats), grads = jax.value_and_grad(lambda t: _minibatch_loss(policy, args, t, mbatch), has_aux=True)(trainable)
    return stats, data, grads


@functools.lru_cache(maxsize=None)
def _first_minibatch_fn(module, args):
    return jax.jit(functools.partial(_first_minibatch, module, args))


def ppo_step_loss_and_grads(policy, trainable, batch: dict, args: PPOArgs, kl_coef: float | None = None):
    """The step's first mini-batch (rows 0..mini_batch_size-1), no update -> (loss terms, batch tensors,
    grads {PEFT / v_head name: array, torch layout}), as the torch twin."""
    kl = jnp.asarray(args.init_kl_coef if kl_coef is None else kl_coef, jnp.float32)
    stats, data, grads = _first_minibatch_fn(policy.module, args)(policy.params, trainable, kl,
                                                                  {k: jnp.asarray(v) for k, v in batch.items()})
    terms = {k: float(stats[f"loss/{k}"]) for k in ("policy", "value", "total")}
    tensors = {k: np.asarray(data[k]) for k in ("logprobs", "ref_logprobs", "values", "masks", "advantages",
                                                "returns", "kls")}
    return terms, tensors, {**lora_state_dict(grads["lora"]), **value_head_state_dict(grads["v_head"])}


# ---- the loop ----------------------------------------------------------------------------------

def _rollout(module, reward_module, args, eos_token_ids, pad_token_id, params, lora, reward_params,
             reward_v_head, prompt_ids, prompt_mask, noise, vision=None):
    reward = CausalLMWithValueHead(reward_module, reward_params)
    responses = _generate_by_mini_batch(module, args, eos_token_ids, pad_token_id, params, lora, prompt_ids,
                                        prompt_mask, noise, vision)
    start, query_len, response_len = _rollout_lengths(prompt_ids, responses, pad_token_id, eos_token_ids[0],
                                                      None if vision is None else prompt_mask)
    inputs = _model_inputs(prompt_ids, start, query_len, responses, response_len, pad_token_id)
    if vision is not None:  # the reward model (text) reads the ids only
        inputs_vl = _vision_inputs(vision, start, query_len, response_len, inputs["input_ids"].shape[1],
                                   _text_features(module, params, _token_features(vision)))
    cut = jnp.where(jnp.arange(responses.shape[1])[None] < response_len[:, None], responses, -1)
    batch = {**inputs, "query_len": query_len, "response_len": response_len,
             "scores": _scores(reward, reward_v_head, inputs)}
    return (batch if vision is None else {**batch, **inputs_vl}), cut


@functools.lru_cache(maxsize=None)
def _rollout_fn(module, reward_module, args, eos_token_ids, pad_token_id):
    return jax.jit(functools.partial(_rollout, module, reward_module, args, eos_token_ids, pad_token_id))


def rollout(policy, lora, reward_model, reward_v_head, prompt_features: list[dict], args: PPOArgs, eos_token_ids,
            pad_token_id: int, step: int, width: int, noise: np.ndarray | None = None,
            mm: MultimodalContext | None = None):
    """One PPO step's rollouts: generate from the prompts left-padded to `width`, trim, score -> (the rollout
    batch {input_ids, attention_mask [B, width + N], query_len, response_len, scores}, the cut responses
    i32[B, N], -1 padded). The noise of mini-batch m is rollout_noise(seed, step, m) unless `noise` is given.
    With `mm` (a VL template's collator context) the prompts bring their images and M-RoPE positions, and the
    batch gains row_positions i32[B,3,W] and the per-token image features token_<keyword> f32[B,W,...]."""
    prompts = PromptDataCollator(pad_token_id, pad_to_length=width, mm=mm)(prompt_features)
    vision = prompt_vision(policy, prompts)
    B, mb, N = len(prompt_features), args.mini_batch_size, args.max_new_tokens
    vocab = policy.module.config.vocab_size
    if noise is None:
        noise = np.concatenate([rollout_noise(args.seed, step, m, (min(mb, B - s), N, vocab))
                                for m, s in enumerate(range(0, B, mb))])
    fn = _rollout_fn(policy.module, reward_model.module, args, tuple(int(e) for e in eos_token_ids),
                     int(pad_token_id))
    return fn(policy.params, lora, reward_model.params, reward_v_head, jnp.asarray(prompts["input_ids"]), jnp.asarray(prompts["attention_mask"]),
              jnp.asarray(noise), None if vision is None else {k: jnp.asarray(v) for k, v in vision.items()})


def _prompt_width(*feature_lists) -> int:
    return max(len(f["input_ids"]) for features in feature_lists for f in features)


def _run(policy, trainable, reward, reward_v_head, step_prompts, args, eos_token_ids, pad_token_id, total_steps, width,
         mm=None):
    opt_state = _adam(args).init(trainable)
    kl_coef = jnp.asarray(args.init_kl_coef, jnp.float32)
    all_stats, all_responses = [], []
    for step, prompts in enumerate(step_prompts):
        batch, responses = rollout(policy, trainable["lora"], reward, reward_v_head, prompts, args, eos_token_ids,
                                   pad_token_id, step, width, mm=mm)
        trainable, opt_state, kl_coef, stats = ppo_step(policy, trainable, opt_state, kl_coef, batch, args, step,
                                                        total_steps)
        all_stats.append(stats)  # on device: no host sync per step
        all_responses.append(responses)
    all_stats, all_responses = jax.device_get((all_stats, all_responses))
    return ({k: [float(s[k]) for s in all_stats] for k in STATS},
            [np.asarray(r, np.int64) for r in all_responses], trainable)


def train_steps(model_dir, reward_model_dir, lora_init: dict, value_head_init: dict, step_prompts: list[list[dict]],
                args: PPOArgs, eos_token_ids, pad_token_id: int, tokenizer_dir=None, data_dir=None):
    """len(step_prompts) PPO steps (rollouts included) from the given adapter and value head. A VL template's
    prompts need tokenizer_dir and data_dir (their images)."""
    policy, trainable = load_policy(model_dir, args, lora_init, value_head_init)
    mm = None if tokenizer_dir is None else make_collator(args, tokenizer_dir, data_dir=data_dir,
                                                          rope_index=getattr(policy.module, "rope_index", None)).mm
    reward, reward_v_head = load_reward_model(reward_model_dir)
    stats, responses, trainable = _run(policy, trainable, reward, reward_v_head, step_prompts, args, eos_token_ids,
                                       pad_token_id, len(step_prompts),
                                       _prompt_width(*step_prompts) + _fake_media_length(mm), mm)
    return stats, responses, lora_state_dict(trainable["lora"]), value_head_state_dict(trainable["v_head"])


def evaluate_reward(policy, lora, reward, reward_v_head, features: list[dict], args: PPOArgs, eos_token_ids,
                    pad_token_id: int, width: int, mm: MultimodalContext | None = None) -> float:
    """Mean reward of eval_samples sampled responses per prompt (eval_noise), in eval batches."""
    size, vocab = args.per_device_eval_batch_size, policy.module.config.vocab_size
    eval_args = replace(args, per_device_train_batch_size=size)
    scores = []
    for k in range(args.eval_samples):
        for b, s in enumerate(range(0, len(features), size)):
            prompts = features[s:s + size]
            noise = eval_noise(k, b, (len(prompts), args.max_new_tokens, vocab))
            scores.append(rollout(policy, lora, reward, reward_v_head, prompts, eval_args, eos_token_ids, pad_token_id,
                                  0, width, noise, mm)[0]["scores"])
    return float(np.mean(np.concatenate(jax.device_get(scores)).astype(np.float64)))


def train_ppo(model_dir, tokenizer_dir, data_dir, reward_model_dir, args: PPOArgs = PPOArgs()) -> PPOResult:
    """End to end from data_dir/{train,eval}.json (alpaca rows: their prompts) to a trained adapter and value head."""
    start = time.perf_counter()
    train = load_prompt_dataset(tokenizer_dir, data_dir, "train", args)
    held_out = load_prompt_dataset(tokenizer_dir, data_dir, "eval", args)
    eos_token_ids, pad_token_id = generation_ids(tokenizer_dir, args)
    policy, trainable = load_policy(model_dir, args)
    # M-RoPE models: LF's collator asks the model for positions
    mm = make_collator(args, tokenizer_dir, data_dir=data_dir, rope_index=getattr(policy.module, "rope_index", None)).mm
    width = _prompt_width(train, held_out) + _fake_media_length(mm)  # one static prompt width
    reward, reward_v_head = load_reward_model(reward_model_dir)
    eval_before = evaluate_reward(policy, trainable["lora"], reward, reward_v_head, held_out, args, eos_token_ids,
                                  pad_token_id, width, mm)
    step_prompts = [[train[i] for i in idx] for epoch in range(args.num_train_epochs)
                    for idx in prompt_batch_indices(len(train), args, epoch)]
    stats, responses, trainable = _run(policy, trainable, reward, reward_v_head, step_prompts, args, eos_token_ids,
                                       pad_token_id, num_training_steps(len(train), args), width, mm)
    eval_after = evaluate_reward(policy, trainable["lora"], reward, reward_v_head, held_out, args, eos_token_ids,
                                 pad_token_id, width, mm)
    return PPOResult(stats, responses, eval_before, eval_after, lora_state_dict(trainable["lora"]),
                     value_head_state_dict(trainable["v_head"]), time.perf_counter() - start)
