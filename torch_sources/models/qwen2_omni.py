"""Qwen2.5-Omni's thinker in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' Qwen2_5OmniThinkerForConditionalGeneration is Qwen2-VL's recipe with Omni's parts: a Qwen2
language model (biased q/k/v) under M-RoPE in contiguous t | h | w sections, fed by the Qwen2.5-VL tower with
separate q/k/v (windowed blocks, RMSNorm, gated MLP; models/vision.py) and by an audio encoder
(models/audio.py). What is the thinker's own: its config (nested under the wrapper's `thinker_config`, token
ids named `*_token_index`), its rope index (models/mrope.py `get_rope_index_omni`: images found from token ids,
blocks chained at the previous largest position + 1, pads at position 1, a text-only batch on its own path),
an untied head by default (the head ties only by the thinker-level `tie_word_embeddings`), and the checkpoint
names `thinker.model.*`, `thinker.visual.*`, `thinker.audio_tower.*`, `thinker.lm_head.weight`.

Scope: the forward places images and audio; videos (and their tokens) are refused. Audio comes as the
feature extractor's input_features f32[A, mel, frames] with feature_attention_mask [A, frames]: each audio's
masked frames go through the audio tower (`encode_audio`, transformers' get_audio_features) and its rows replace
the audio tokens, as the image rows replace the image tokens (`audio_embeds`: the tower's output computed once by
a trainer). LF's collator adds a fake audio to every batch (training/collator.py), masked and unlabelled, so its
rows reach no loss; the audio tower is frozen under LoRA. Without an attention_mask the forward takes every token
as real and still places the images by the rope index; transformers' thinker then skips its rope index (0..T-1
on all three rows), a path no collator or generate call takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import mrope
from torch_sources.models.audio import Qwen2_5OmniAudioConfig, Qwen2_5OmniAudioEncoder
from torch_sources.models.config_keys import ALL_FULL, DROPOUT, ConfigError, KeyAudit
from torch_sources.models.loading import iter_tensors, load_config
from torch_sources.models.qwen2 import Qwen2Config
from torch_sources.models.qwen2_vl import (LanguageModelView, Qwen2VLTextModel, layer_inputs, merge_image_embeddings,
                                          read_text_config)
from torch_sources.models.vision import Qwen2_5VisionTransformer, Qwen2_5VLVisionConfig

AUTO_MODEL = ("qwen2_5_omni", "Qwen2OmniThinkerForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "WRAPPER_KEYS", "Qwen2OmniConfig",
    "layer_inputs", "merge_image_embeddings", "merge_audio_embeddings", "refuse_unplaced_tokens",
    "Qwen2OmniThinkerTextModel", "Qwen2OmniThinkerForConditionalGeneration",
]

# text_config (Qwen2_5OmniTextConfig): Qwen2's keys under M-RoPE
TEXT_KEYS = KeyAudit(
    "qwen2_5_omni text",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                       "rope_theta", "rope_scaling", "rope_parameters"}),
    ignored={"attention_dropout": DROPOUT,
             "sliding_window": "read only under use_sliding_window, which is refused",
             "max_window_layers": "read only under use_sliding_window, which is refused",
             "tie_word_embeddings": "transformers 5.24 ties the thinker's head by the thinker-level key, not this one"},
    refused={"hidden_act": (("silu",), "SwiGLU is Qwen2's MLP"),
             "use_sliding_window": ((False, None), "Qwen2 sliding-window layers (no release turns them on)"),
             "layer_types": ((None, ALL_FULL), "a sliding layer needs use_sliding_window, refused")})

# thinker_config (Qwen2_5OmniThinkerConfig); the *_token_id spellings are transformers' attribute_map aliases
_IDS = ("image_token_index", "image_token_id", "video_token_index", "video_token_id", "audio_token_index",
        "audio_token_id", "vision_start_token_id", "audio_start_token_id")
CONFIG_KEYS = KeyAudit(
    "qwen2_5_omni thinker",
    honored=frozenset({"text_config", "vision_config", "audio_config", "tie_word_embeddings", *_IDS}),
    ignored={"vision_end_token_id": "closes an image span in the text; the rope index never reads it",
             "audio_end_token_id": "closes an audio span in the text; the rope index never reads it",
             "vision_token_id": "not read by transformers' thinker",
             "user_token_id": "read by the talker (speech output), not the thinker",
             "position_id_per_seconds": "scales the temporal positions of videos, audio and multi-frame grids, "
                                        "all refused (a still image's single frame sits at 0)",
             "seconds_per_chunk": "interleaves audio-in-video positions, refused"})

# the wrapper (Qwen2_5OmniConfig): the thinker plus the speech-output modules this source does not build
WRAPPER_KEYS = KeyAudit(
    "qwen2_5_omni",
    honored=frozenset({"thinker_config"}),
    ignored={"enable_audio_output": "builds the talker and token2wav (speech output); the thinker's logits "
                                    "do not depend on it",
             "talker_config": "the talker (speech output), not built here",
             "token2wav_config": "the token-to-waveform model (speech output), not built here"})


@dataclass(frozen=True)
class Qwen2OmniConfig(LanguageModelView):
    text: Qwen2Config
    vision: Qwen2_5VLVisionConfig
    audio: Qwen2_5OmniAudioConfig
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2OmniConfig":
        """The wrapper's config.json (model_type qwen2_5_omni, the thinker under `thinker_config`) or a bare
        thinker config (qwen2_5_omni_thinker); every key of the wrapper, the thinker and its sub-configs
        accounted for."""
        if "thinker_config" in d:
            WRAPPER_KEYS.check(d)
            d = d["thinker_config"]
        CONFIG_KEYS.check(d)
        missing = [k for k in ("text_config", "vision_config", "audio_config", "vision_start_token_id") if k not in d]
        if missing:
            raise ConfigError(f"qwen2_5_omni thinker config: no {missing} (transformers would build the 7B "
                              f"defaults or, for vision_start_token_id, fail in its rope index)")
        TEXT_KEYS.check(d["text_config"])
        tie = bool(d.get("tie_word_embeddings", False))
        text, section = read_text_config({**d["text_config"], "tie_word_embeddings": tie}, "qwen2_5_omni config")
        # the thinker always builds Omni's encoder (separate q/k/v), whatever model_type the dict names
        vision = dataclasses.replace(Qwen2_5VLVisionConfig.from_hf(d["vision_config"]), separate_qkv=True)

        def token(name: str, default: int) -> int:
            return int(d.get(f"{name}_token_index", d.get(f"{name}_token_id", default)))
        return cls(text=text, vision=vision, audio=Qwen2_5OmniAudioConfig.from_hf(d["audio_config"]),
                   mrope_section=section, image_token_id=token("image", 151655), video_token_id=token("video", 151656),
                   audio_token_id=token("audio", 151646), vision_start_token_id=int(d["vision_start_token_id"]),
                   audio_start_token_id=int(d.get("audio_start_token_id", 151647)), tie_word_embeddings=tie)

    @classmethod
    def from_pretrained(cls, path) -> "Qwen2OmniConfig":
        return cls.from_hf(load_config(path))


def _thinker_state(named_tensors):
    """(HF name, tensor) pairs -> {thinker-relative name: tensor}: `thinker.` stripped, the speech-output modules
    (`talker.*`, `token2wav.*`, present when enable_audio_output) dropped as transformers' thinker drops them;
    any other name is refused."""
    state = {}
    for name, tensor in named_tensors:
        if name.startswith(("talker.", "token2wav.")):
            continue
        if not name.startswith("thinker."):
            raise ValueError(f"{name}: not a Qwen2.5-Omni tensor (thinker.*, talker.*, token2wav.*)")
        state[name[len("thinker."):]] = tensor
    return state


# ---- operators ------------------------------------------------------------------------------

def refuse_unplaced_tokens(input_ids, config: Qwen2OmniConfig, has_audio: bool,
                           video_as_text: bool = False) -> None:
    """Video tokens are never placed; audio tokens only with audio (input_features or audio_embeds): refuse
    the rest rather than leave their placeholder embeddings in the sequence (video_as_text: a video token is
    text, its own embedding, as in a decode step)."""
    if not video_as_text and bool((input_ids == config.video_token_id).any()):
        raise ValueError(f"video token {config.video_token_id} in input_ids: this thinker forward places images and "
                         f"audio only (video inputs are out of scope)")
    if not has_audio and bool((input_ids == config.audio_token_id).any()):
        raise ValueError(f"audio token {config.audio_token_id} in input_ids but no input_features (or audio_embeds)")


def merge_audio_embeddings(embeds, input_ids, audio_embeds, audio_token_id: int, check_count: bool = True):
    """f32[B,T,D], i64[B,T], f32[n,D] -> f32[B,T,D]: the audio tokens' rows, in reading order, replaced by the
    audio tower's (transformers' masked_scatter); the counts must agree (check_count=False: rows past them)."""
    n = int((input_ids == audio_token_id).sum())
    if check_count and n != audio_embeds.shape[0]:
        raise ValueError(f"audio features and audio tokens do not match: {n} tokens, {audio_embeds.shape[0]} features")
    return merge_image_embeddings(embeds, input_ids, audio_embeds, audio_token_id, check_count=False)


# ---- modules --------------------------------------------------------------------------------

Qwen2OmniThinkerTextModel = Qwen2VLTextModel  # the same decoder stack (`model.*`): Qwen2 blocks under M-RoPE


class Qwen2OmniThinkerForConditionalGeneration(nn.Module):
    """The checkpoint's thinker tree: `model` (language model), `visual`, `audio_tower`, `lm_head`."""

    def __init__(self, config: Qwen2OmniConfig):
        super().__init__()
        self.config = config
        self.model = Qwen2OmniThinkerTextModel(config)
        self.visual = Qwen2_5VisionTransformer(config.vision)
        self.audio_tower = Qwen2_5OmniAudioEncoder(config.audio)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope_index(self, input_ids, image_grid_thw, attention_mask, audio_seqlens=None):  # -> i64[3,B,T], i64[B,1]
        """audio_seqlens i64[A]: each audio's feature frames (feature_attention_mask.sum(-1))."""
        c = self.config
        return mrope.get_rope_index_omni(
            input_ids, image_grid_thw, attention_mask, image_token_id=c.image_token_id,
            vision_start_token_id=c.vision_start_token_id, video_token_id=c.video_token_id,
            audio_token_id=c.audio_token_id, audio_start_token_id=c.audio_start_token_id,
            spatial_merge_size=c.vision.spatial_merge_size, audio_seqlens=audio_seqlens)

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.embed_tokens(input_ids)

    def encode_images(self, pixel_values, image_grid_thw):  # f32[P, C*2*14*14], i64[I,3] -> f32[P/4, D]
        """The tower's merged patch embeddings: what replaces the image tokens (frozen under LoRA, so a trainer
        may compute them once per batch)."""
        return self.visual(pixel_values, image_grid_thw)

    def audio_features(self, input_features, feature_lens):
        """The audio tower alone: input_features f32[mel, F] (every audio's frames concatenated), feature_lens
        i64[A] -> f32[sum of audio.audio_output_lengths(feature_lens), output_dim]."""
        return self.audio_tower(input_features, feature_lens)

    def encode_audio(self, input_features, feature_attention_mask):  # f32[A, mel, F], [A, F] -> f32[n, output_dim]
        """transformers' get_audio_features: each audio's masked frames, concatenated along time, through the
        tower; one row per audio token (frozen under LoRA, so a trainer may compute them once per batch)."""
        mask = feature_attention_mask.bool()
        frames = input_features.permute(0, 2, 1)[mask].T  # f32[mel, sum of the audios' frames]
        return self.audio_features(frames, feature_attention_mask.long().sum(-1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                return_hidden: bool = False, image_embeds=None, input_features=None, feature_attention_mask=None,
                audio_embeds=None, video_tokens_as_text: bool = False):
        """input_ids i64[B,T], attention_mask i64[B,T], position_ids i64[3,B,T] (None: the thinker's rope index
        of the batch), pixel_values f32[P, C*2*14*14], image_grid_thw i64[I,3] (or image_embeds f32[n,D],
        encode_images' output), input_features f32[A, mel, F] with feature_attention_mask [A, F] (or
        audio_embeds f32[m, output_dim], encode_audio's output) -> logits f32[B,T,V] (and the final hidden states
        with return_hidden). video_tokens_as_text (position_ids given): a video token is text, embedded as such, as
        transformers' decode steps embed a sampled one (PPO's responses); otherwise video tokens are refused."""
        c = self.config
        if video_tokens_as_text and position_ids is None:
            raise ValueError("video_tokens_as_text needs position_ids: the rope index would place a video token")
        refuse_unplaced_tokens(input_ids, c, input_features is not None or audio_embeds is not None,
                               video_tokens_as_text)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            seqlens = None if feature_attention_mask is None else feature_attention_mask.long().sum(-1)
            position_ids, _ = self.rope_index(input_ids, image_grid_thw, attention_mask, seqlens)
        embeds = self.model.embed_tokens(input_ids)
        if input_features is not None:
            audio_embeds = self.encode_audio(input_features, feature_attention_mask)
        if audio_embeds is not None:
            embeds = merge_audio_embeddings(embeds, input_ids, audio_embeds, c.audio_token_id)
        if pixel_values is not None:
            image_embeds = self.encode_images(pixel_values, image_grid_thw)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id)
        hidden = self.model(embeds, layer_inputs(c, attention_mask, position_ids))
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the wrapper's `thinker.*` layout), fp32, eval mode. A tied
        thinker may store no head, or the shared copy."""
        config = Qwen2OmniConfig.from_pretrained(path)
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = cls(config)
        state = {k: v.to(torch.float32) for k, v in _thinker_state(iter_tensors(path)).items()}
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()
