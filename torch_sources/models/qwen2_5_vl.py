"""Qwen2.5-VL in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_qwen2_5_vl.py is Qwen2-VL's recipe (models/qwen2_vl.py: a Qwen2 language model with biased
q/k/v under M-RoPE in contiguous t | h | w sections, the merged patch embeddings replacing the `<|image_pad|>`
tokens' embeddings, the same rope index for images) with the Qwen2.5-VL tower (models/vision.py: windowed
blocks and a few full-attention ones, RMSNorms, a biased SiLU-gated MLP, the fused `attn.qkv` the release
stores). transformers 5.24's Qwen2_5_VLConfig and Qwen2_5_VLTextConfig carry exactly Qwen2-VL's keys, so the
audits are Qwen2-VL's under this family's name. What is Qwen2.5-VL's own here: its vision config and tower, and
the checkpoint names as the release stores them (`model.*` for the language model, `visual.*` for the tower,
`lm_head.weight`: the 7B release's head is untied; the 3B's ties it).

Scope: images. Video tokens are refused wherever the rope index would place them (a forward without
position_ids); with position_ids given a video token is text, as in a decode step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import qwen2_vl
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.qwen2 import Qwen2Config
from torch_sources.models.qwen2_vl import (LanguageModelView, Qwen2VLForConditionalGeneration, Qwen2VLTextModel,
                                           layer_inputs, merge_image_embeddings, qwen_vl_fields)
from torch_sources.models.vision import Qwen2_5VisionTransformer, Qwen2_5VLVisionConfig

AUTO_MODEL = ("qwen2_5_vl", "Qwen2_5VLForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "Qwen2_5VLConfig", "layer_inputs", "merge_image_embeddings", "refuse_videos",
    "Qwen2_5VLTextModel", "Qwen2_5VLForConditionalGeneration",
]

_NOT_READ = {"vision_token_id": "not read by transformers' Qwen2.5-VL"}
# Qwen2-VL's keys at both levels (the release's flat text keys, transformers 5's text_config), under this name
TEXT_KEYS = dataclasses.replace(qwen2_vl.TEXT_KEYS, family="qwen2_5_vl text",
                                ignored={**qwen2_vl.TEXT_KEYS.ignored, **_NOT_READ})
CONFIG_KEYS = dataclasses.replace(qwen2_vl.CONFIG_KEYS, family="qwen2_5_vl",
                                  ignored={**qwen2_vl.CONFIG_KEYS.ignored, **_NOT_READ})


@dataclass(frozen=True)
class Qwen2_5VLConfig(LanguageModelView):
    text: Qwen2Config
    vision: Qwen2_5VLVisionConfig
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2_5VLConfig":
        """Either layout: the release's flat text keys beside `vision_config`, or transformers 5's `text_config`."""
        # transformers' Qwen2.5-VL always builds the fused qkv, whatever model_type the vision dict names
        vision = dataclasses.replace(Qwen2_5VLVisionConfig.from_hf(d["vision_config"]), separate_qkv=False)
        return cls(vision=vision, **qwen_vl_fields(d, CONFIG_KEYS, TEXT_KEYS, "qwen2_5_vl config"))

    @classmethod
    def from_pretrained(cls, path) -> "Qwen2_5VLConfig":
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def refuse_videos(input_ids, config: Qwen2_5VLConfig) -> None:
    """Video tokens are never placed (no video processor, no second_per_grid_ts): refuse them rather than leave
    their placeholder embeddings in the sequence."""
    if bool((torch.as_tensor(input_ids) == config.video_token_id).any()):
        raise ValueError(f"video token {config.video_token_id} in input_ids: this Qwen2.5-VL source places images "
                         f"only (video inputs are out of scope)")


# ---- modules --------------------------------------------------------------------------------

Qwen2_5VLTextModel = Qwen2VLTextModel  # the same decoder stack (`model.*`): Qwen2 blocks under M-RoPE


class Qwen2_5VLForConditionalGeneration(nn.Module):
    """The release's module tree: `model` (language model), `visual` (the Qwen2.5-VL tower), `lm_head`.
    Past the tower everything is Qwen2-VL's, so its methods are used as they are."""

    def __init__(self, config: Qwen2_5VLConfig):
        super().__init__()
        self.config = config
        self.model = Qwen2_5VLTextModel(config)
        self.visual = Qwen2_5VisionTransformer(config.vision)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope_index(self, input_ids, image_grid_thw, attention_mask):  # -> i64[3,B,T], i64[B,1]
        """Qwen2-VL's rope index (images by their token type), video tokens refused."""
        refuse_videos(input_ids, self.config)
        return Qwen2VLForConditionalGeneration.rope_index(self, input_ids, image_grid_thw, attention_mask)

    embed = Qwen2VLForConditionalGeneration.embed  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
    encode_images = Qwen2VLForConditionalGeneration.encode_images  # f32[P, C*2*14*14], i64[I,3] -> f32[P/4, D]
    forward = Qwen2VLForConditionalGeneration.forward  # (input_ids, attention_mask, position_ids, pixel_values, ...)

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout), fp32, eval mode."""
        return load_pretrained(cls, Qwen2_5VLConfig.from_pretrained(path), path)
