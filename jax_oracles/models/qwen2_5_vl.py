"""Qwen2.5-VL in Flax Linen: the torch-free twin of torch_sources/models/qwen2_5_vl.py.

Qwen2-VL's recipe (models/qwen2_vl.py: Qwen2 blocks under M-RoPE, the merged patch embeddings replacing the image
tokens' rows, the same rope index for images) fed by the Qwen2.5-VL tower (models/vision.py: windowed blocks, RMSNorms,
a biased SiLU-gated MLP, fused qkv). Same public names in the same order; params named after the HF checkpoint
(`model/...`, `visual/...`, `lm_head`; see conversion/qwen2_5_vl.py). The image grid is static host data, as
everything the tower derives from it; the rope index is host numpy too (data-dependent), so a jitted caller passes
position_ids. Video tokens are refused where the rope index would place them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

from jax_oracles.models import qwen2_vl
from jax_oracles.models.qwen2 import Qwen2Config
from jax_oracles.models.qwen2_vl import (LanguageModelView, Qwen2VLForConditionalGeneration, Qwen2VLTextModel,
                                         layer_inputs, merge_image_embeddings, qwen_vl_fields)
from jax_oracles.models.vision import Qwen2_5VisionTransformer, Qwen2_5VLVisionConfig

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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---- operators ------------------------------------------------------------------------------

def refuse_videos(input_ids, config: Qwen2_5VLConfig) -> None:
    """Video tokens are never placed (no video processor, no second_per_grid_ts): refuse them rather than leave
    their placeholder embeddings in the sequence (checked where the ids are concrete: the host-side rope index)."""
    if isinstance(input_ids, jax.core.Tracer):
        return
    if (np.asarray(input_ids) == config.video_token_id).any():
        raise ValueError(f"video token {config.video_token_id} in input_ids: this Qwen2.5-VL source places images "
                         f"only (video inputs are out of scope)")


# ---- modules --------------------------------------------------------------------------------

Qwen2_5VLTextModel = Qwen2VLTextModel  # the same decoder stack (`model/...`): Qwen2 blocks under M-RoPE


class Qwen2_5VLForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, position_ids,
    pixel_values, image_grid_thw); the release's tree: `model` (language model), `visual` (the Qwen2.5-VL tower),
    `lm_head`. Past the tower everything is Qwen2-VL's, so its methods are used as they are."""
    config: Qwen2_5VLConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        c = self.config
        self.model = Qwen2_5VLTextModel(c, self.lora_scaling)
        self.visual = Qwen2_5VisionTransformer(c.vision)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def rope_index(self, input_ids, image_grid_thw, attention_mask):  # host numpy -> i64[3,B,T], i64[B,1]
        """Qwen2-VL's rope index (images by their token type), video tokens refused."""
        refuse_videos(input_ids, self.config)
        return Qwen2VLForConditionalGeneration.rope_index(self, input_ids, image_grid_thw, attention_mask)

    embed = Qwen2VLForConditionalGeneration.embed  # i32[B,T] -> f32[B,T,D]: the token embeddings (text only)
    encode_images = Qwen2VLForConditionalGeneration.encode_images  # f32[P, C*2*14*14], (host) [I,3] -> f32[P/4, D]
    __call__ = Qwen2VLForConditionalGeneration.__call__  # (input_ids, attention_mask, position_ids, pixel_values, ...)
