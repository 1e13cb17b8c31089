"""Qwen2-VL in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_qwen2_vl.py is a Qwen2 language model (biased q/k/v, head_dim = hidden / heads) whose
RoPE is multimodal (M-RoPE: three position rows, temporal / height / width, each owning a section of the
rotary channels), fed by a ViT (models/vision.py) whose merged patch embeddings replace the `<|image_pad|>`
tokens' embeddings. This file composes the Qwen2 blocks, the shared tower and models/mrope.py, and keeps only
what is Qwen2-VL's own: its config keys (the release's flat form and transformers 5's nested one) and the
checkpoint names (`model.*` for the language model, `visual.*` for the tower, as the release stores them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import mrope, rope
from torch_sources.models.config_keys import ALL_FULL, BOOKKEEPING, DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import LayerInputs, RMSNorm, causal_mask
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.qwen2 import Qwen2Config, Qwen2DecoderLayer
from torch_sources.models.vision import Qwen2VisionTransformer, Qwen2VLVisionConfig

AUTO_MODEL = ("qwen2_vl", "Qwen2VLForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "LanguageModelView", "Qwen2VLConfig", "read_text_config", "qwen_vl_fields",
    "layer_inputs", "merge_image_embeddings",
    "Qwen2VLTextModel", "Qwen2VLForConditionalGeneration",
]

# The language model's keys: the release keeps them at the top level, transformers 5 nests them in text_config.
TEXT_KEYS = KeyAudit(
    "qwen2_vl text",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                       "rope_theta", "rope_scaling", "rope_parameters"}),
    ignored={"attention_dropout": DROPOUT,
             "sliding_window": "read only under use_sliding_window, which is refused",
             "max_window_layers": "read only under use_sliding_window, which is refused",
             "image_token_id": "read from the top level", "video_token_id": "read from the top level",
             "vision_start_token_id": "read from the top level", "vision_end_token_id": "read from the top level",
             "vision_token_id": "not read by transformers' Qwen2-VL"},
    refused={"hidden_act": (("silu",), "SwiGLU is Qwen2's MLP"),
             "use_sliding_window": ((False, None), "Qwen2 sliding-window layers (no release turns them on)"),
             "layer_types": ((None, ALL_FULL), "a sliding layer needs use_sliding_window, refused")})

# The top level: the text keys (flat release form) plus the multimodal ones.
CONFIG_KEYS = KeyAudit(
    "qwen2_vl",
    honored=TEXT_KEYS.honored | {"text_config", "vision_config", "image_token_id", "video_token_id",
                                 "vision_start_token_id"},
    ignored={**{k: v for k, v in TEXT_KEYS.ignored.items() if k not in {"image_token_id", "video_token_id",
                                                                          "vision_start_token_id"}},
             "vision_end_token_id": "closes an image span in the text; positions never read it"},
    refused=dict(TEXT_KEYS.refused))


def read_text_config(d: dict, what: str) -> tuple[Qwen2Config, tuple[int, int, int]]:
    """The language model's Qwen2Config and the M-RoPE sections from the text keys (either RoPE form: the
    release's `rope_scaling: {type: mrope, mrope_section}` + `rope_theta`, or transformers 5's
    `rope_parameters: {rope_type: default, mrope_section, rope_theta}`)."""
    block = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    section = block.pop("mrope_section", None)
    if section is None:
        raise ConfigError(f"{what}: no mrope_section in the rope block (a Qwen-VL language model rotates by three "
                          f"position rows)")
    if block.pop("type", None) == "mrope" or block.get("rope_type") == "mrope":  # the release's name for default
        block["rope_type"] = "default"
    if block.get("rope_type", "default") != "default":  # no Qwen-VL release scales its M-RoPE
        raise ConfigError(f"{what}: rope_type {block['rope_type']!r} under M-RoPE (only the default table: "
                          f"transformers would scale cos/sin by the type's attention factor)")
    head_dim = d["hidden_size"] // d["num_attention_heads"]  # Qwen2-VL's attention ignores any head_dim key
    table = rope.read_rope({"rope_parameters": block, "rope_theta": d.get("rope_theta"),
                            "max_position_embeddings": d.get("max_position_embeddings")},
                           head_dim, default_theta=1_000_000.0, what=what)
    if len(section) != 3 or 2 * sum(section) != table.dim:
        raise ConfigError(f"{what}: mrope_section {section} must be three counts covering the {table.dim} rotary "
                          f"channels twice over")
    text = Qwen2Config(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                       num_attention_heads=d["num_attention_heads"],
                       num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                       head_dim=head_dim, rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope=table,
                       max_position_embeddings=d.get("max_position_embeddings", 32768),
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    return text, tuple(int(s) for s in section)


def qwen_vl_fields(d: dict, config_keys: KeyAudit, text_keys: KeyAudit, what: str) -> dict:
    """A Qwen-VL config's fields beside its vision config, read the same way by every Qwen-VL family: the audits,
    the language model (the release's flat text keys, or transformers 5's text_config), its M-RoPE sections, the
    head tie (the top level's key wins) and the image / video / vision-start token ids (the releases' defaults)."""
    config_keys.check(d)
    text_d = dict(d.get("text_config") or {k: v for k, v in d.items() if k in text_keys.keys})
    if "text_config" in d:
        text_keys.check({k: v for k, v in text_d.items() if k not in BOOKKEEPING})
    tie = bool(d.get("tie_word_embeddings", text_d.get("tie_word_embeddings", False)))
    text_d["tie_word_embeddings"] = tie
    text, section = read_text_config(text_d, what)
    return dict(text=text, mrope_section=section, image_token_id=int(d.get("image_token_id", 151655)),
                video_token_id=int(d.get("video_token_id", 151656)),
                vision_start_token_id=int(d.get("vision_start_token_id", 151652)), tie_word_embeddings=tie)


class LanguageModelView:
    """The family-neutral names the generic checks read, off a vision-language config's language model (`text`)."""

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def norm_eps(self) -> float:
        return self.text.rms_norm_eps

    @property
    def num_attention_heads(self) -> int:
        return self.text.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.text.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.text.head_dim


@dataclass(frozen=True)
class Qwen2VLConfig(LanguageModelView):
    text: Qwen2Config
    vision: Qwen2VLVisionConfig
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2VLConfig":
        """Either layout: the release's flat text keys beside `vision_config`, or transformers 5's `text_config`."""
        return cls(vision=Qwen2VLVisionConfig.from_hf(d["vision_config"]),
                   **qwen_vl_fields(d, CONFIG_KEYS, TEXT_KEYS, "qwen2_vl config"))

    @classmethod
    def from_pretrained(cls, path) -> "Qwen2VLConfig":
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def layer_inputs(config: Qwen2VLConfig, attention_mask, position_ids) -> LayerInputs:
    """Causal + padding mask and the M-RoPE cos/sin (position_ids i64[3,B,T]) every layer shares."""
    cos, sin = mrope.mrope_cos_sin(rope.inv_freq(config.text.rope), position_ids, config.mrope_section,
                                   interleaved=False)
    return LayerInputs(causal_mask(attention_mask), cos, sin)


def merge_image_embeddings(embeds, input_ids, image_embeds, image_token_id: int, check_count: bool = True):
    """f32[B,T,D], i64[B,T], f32[n,D] -> f32[B,T,D]: the n image-token rows, in reading order, replaced by the
    merged patch embeddings (transformers' masked_scatter); the counts must agree (check_count=False: image_embeds
    may carry rows past them, never read)."""
    mask = input_ids == image_token_id
    if check_count and int(mask.sum()) != image_embeds.shape[0]:
        raise ValueError(f"image features and image tokens do not match: {int(mask.sum())} tokens, "
                         f"{image_embeds.shape[0]} features")
    return embeds.masked_scatter(mask[..., None], image_embeds[:int(mask.sum())].to(embeds.dtype))


# ---- modules --------------------------------------------------------------------------------

class Qwen2VLTextModel(nn.Module):
    """Qwen2's decoder stack under M-RoPE, fed embeddings (the image rows already merged in)."""

    def __init__(self, config: Qwen2VLConfig):
        super().__init__()
        t = config.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(t) for _ in range(t.num_hidden_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)

    def forward(self, embeds, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class Qwen2VLForConditionalGeneration(nn.Module):
    """The release's module tree: `model` (language model), `visual` (tower), `lm_head`."""

    def __init__(self, config: Qwen2VLConfig):
        super().__init__()
        self.config = config
        self.model = Qwen2VLTextModel(config)
        self.visual = Qwen2VisionTransformer(config.vision)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope_index(self, input_ids, image_grid_thw, attention_mask):  # -> i64[3,B,T], i64[B,1]
        c = self.config
        types = mrope.token_types(input_ids, image_token_id=c.image_token_id, video_token_id=c.video_token_id)
        return mrope.get_rope_index(input_ids, image_grid_thw, attention_mask, mm_token_type_ids=types,
                                    spatial_merge_size=c.vision.spatial_merge_size)

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.embed_tokens(input_ids)

    def encode_images(self, pixel_values, image_grid_thw):  # f32[P, C*2*14*14], i64[I,3] -> f32[P/4, D]
        """The tower's merged patch embeddings: what replaces the image tokens (frozen under LoRA, so a trainer
        may compute them once per batch)."""
        return self.visual(pixel_values, image_grid_thw)

    def forward(self, input_ids, attention_mask=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                return_hidden: bool = False, image_embeds=None):
        """input_ids i64[B,T], attention_mask i64[B,T], position_ids i64[3,B,T] (None: the rope index of the
        batch, as LLaMA-Factory's collator computes it), pixel_values f32[P, C*2*14*14], image_grid_thw
        i64[I,3] (or image_embeds f32[n,D], encode_images' output) -> logits f32[B,T,V] (and the final hidden
        states with return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids, _ = self.rope_index(input_ids, image_grid_thw, attention_mask)
        embeds = self.model.embed_tokens(input_ids)
        if pixel_values is not None:
            image_embeds = self.encode_images(pixel_values, image_grid_thw)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, self.config.image_token_id)
        hidden = self.model(embeds, layer_inputs(self.config, attention_mask, position_ids))
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout), fp32, eval mode."""
        return load_pretrained(cls, Qwen2VLConfig.from_pretrained(path), path)
