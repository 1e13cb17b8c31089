"""Qwen3-VL in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_qwen3_vl.py is a Qwen3 language model (q_norm / k_norm, explicit head_dim, no biases) whose
RoPE is interleaved M-RoPE (pair i turns with the t, h or w row as i % 3 says, the pairs past 3 * section[1|2]
with t), fed by the Qwen3-VL tower (models/vision.py): its merged patch embeddings replace the `<|image_pad|>`
tokens' embeddings, and DeepStack adds the tower's deepstack features (block outputs through their own mergers)
to the hidden states at those same positions after decoder layer k, for k < len(deepstack). This file composes
the Qwen3 blocks, the shared tower and models/mrope.py, and keeps only what is Qwen3-VL's own: its config keys
(the release's nested `text_config` with `rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`),
the injection, and the checkpoint names (`model.language_model.*`, `model.visual.*`, `lm_head` when untied).

The tower's output may also come precomputed (a LoRA trainer runs the frozen tower once per batch):
`encode_images` gives the forward's image keywords, `image_embeds` f32[n,D] (the merged patches) and
`deepstack_embeds` f32[n,K,D] (row k: the K deepstack features of the k-th image token), both indexed by image
token on axis 0 so a caller pads and gathers them alike; `model(ids, mask, pos, **model.encode_images(px, grid))`
is `model(ids, mask, pos, px, grid)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import mrope, rope
from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import LayerInputs, RMSNorm, causal_mask
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from torch_sources.models.qwen3 import Qwen3Config, Qwen3DecoderLayer
from torch_sources.models.vision import Qwen3VisionTransformer, Qwen3VLVisionConfig

AUTO_MODEL = ("qwen3_vl", "Qwen3VLForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "Qwen3VLConfig", "read_text_config",
    "layer_inputs", "merge_image_embeddings", "add_deepstack",
    "Qwen3VLTextModel", "Qwen3VLModel", "Qwen3VLForConditionalGeneration",
]

# text_config's keys (Qwen3VLTextConfig, plus what the release's file adds: rope_scaling + rope_theta, token ids).
TEXT_KEYS = KeyAudit(
    "qwen3_vl text",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                       "attention_bias", "rope_theta", "rope_scaling", "rope_parameters"}),
    ignored={"attention_dropout": DROPOUT,
             "tie_word_embeddings": "transformers ties on the top-level key only (the release repeats it here)"},
    refused={"hidden_act": (("silu",), "SwiGLU is Qwen3's MLP")})

# The top level: both towers' configs nested, the multimodal ids, the tie.
CONFIG_KEYS = KeyAudit(
    "qwen3_vl",
    honored=frozenset({"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                       "tie_word_embeddings"}),
    ignored={"vision_end_token_id": "closes an image span in the text; positions never read it"})


def read_text_config(d: dict, what: str) -> tuple[Qwen3Config, tuple[int, int, int]]:
    """The language model's Qwen3Config and the M-RoPE sections from text_config (either RoPE form: the release's
    `rope_scaling: {rope_type: default, mrope_section, mrope_interleaved}` + `rope_theta`, or transformers 5's
    `rope_parameters` holding the theta). Only the sections' h and w counts are read by transformers; the t count
    must be what is left (models/mrope.py refuses a section whose real counts differ)."""
    block = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{what}: rope_scaling / rope_parameters must be a dict, got {block!r}")
    block = dict(block)
    section = block.pop("mrope_section", None)
    if section is None:  # transformers falls back to the 8B's [24, 20, 20]; every release states it
        raise ConfigError(f"{what}: no mrope_section in the rope block (a Qwen-VL language model rotates by three "
                          f"position rows)")
    interleaved = block.pop("mrope_interleaved", True)
    if interleaved is not True:
        raise ConfigError(f"{what}: mrope_interleaved={interleaved!r} (transformers' Qwen3-VL interleaves whatever "
                          f"this says; a config asking for blocks is not a Qwen3-VL release)")
    head_dim = d.get("head_dim", 128)  # Qwen3VLTextConfig's default, not hidden / heads
    table = rope.read_rope({"rope_parameters": block, "rope_theta": d.get("rope_theta"),
                            "max_position_embeddings": d.get("max_position_embeddings")},
                           head_dim, default_theta=500_000.0, what=what)  # Qwen3VLTextConfig.default_theta
    if table.rope_type != "default":
        raise ConfigError(f"{what}: rope_type {table.rope_type!r} under M-RoPE (every Qwen3-VL release rotates by "
                          f"the default table; scaled types are not mirrored here)")
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise ConfigError(f"{what}: mrope_section {section!r} must be three counts (t, h, w)")
    try:
        mrope.mrope_axes(section, table.dim // 2, interleaved=True)
    except mrope.MropeError as e:
        raise ConfigError(f"{what}: {e}") from None
    heads = d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads", 32)  # Qwen3VLTextConfig's defaults: 32, and None means MHA
    text = Qwen3Config(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                       num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads,
                       head_dim=head_dim, rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope=table,
                       max_position_embeddings=d.get("max_position_embeddings", 128000),
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                       attention_bias=bool(d.get("attention_bias", False)))
    return text, tuple(int(s) for s in section)


@dataclass(frozen=True)
class Qwen3VLConfig(LanguageModelView):
    text: Qwen3Config
    vision: Qwen3VLVisionConfig
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3VLConfig":
        """Either form of config.json: the release's (text_config with rope_scaling + rope_theta, legacy vision
        model_type) or what transformers 5's save_pretrained writes (text_config.rope_parameters)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"qwen3_vl config: no {key} (Qwen3-VL nests both towers' keys)")
        TEXT_KEYS.check(d["text_config"])
        tie = bool(d.get("tie_word_embeddings", False))  # the outer key: Qwen3VLConfig's default False
        text, section = read_text_config({**d["text_config"], "tie_word_embeddings": tie}, "qwen3_vl config")
        return cls(text=text, vision=Qwen3VLVisionConfig.from_hf(d["vision_config"]), mrope_section=section,
                   image_token_id=int(d.get("image_token_id", 151655)), video_token_id=int(d.get("video_token_id", 151656)),
                   vision_start_token_id=int(d.get("vision_start_token_id", 151652)), tie_word_embeddings=tie)

    @classmethod
    def from_pretrained(cls, path) -> "Qwen3VLConfig":
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def layer_inputs(config: Qwen3VLConfig, attention_mask, position_ids) -> LayerInputs:
    """Causal + padding mask and the interleaved M-RoPE cos/sin (position_ids i64[3,B,T]) every layer shares."""
    cos, sin = mrope.mrope_cos_sin(rope.inv_freq(config.text.rope), position_ids, config.mrope_section,
                                   interleaved=True)
    return LayerInputs(causal_mask(attention_mask), cos, sin)


def add_deepstack(hidden, visual_pos_masks, visual_embeds, check_count: bool = True):
    """f32[B,T,D], bool[B,T], f32[n,D] -> f32[B,T,D]: the n visual rows, in reading order, plus one deepstack
    feature each (transformers' `_deepstack_process`); every other row unchanged. The counts must agree
    (check_count=False: visual_embeds may carry rows past them, never read)."""
    n = int(visual_pos_masks.sum())
    if check_count and n != visual_embeds.shape[0]:
        raise ValueError(f"deepstack features and image tokens do not match: {n} tokens, "
                         f"{visual_embeds.shape[0]} features")
    added = torch.zeros_like(hidden).masked_scatter(visual_pos_masks[..., None], visual_embeds[:n].to(hidden.dtype))
    return hidden + added  # x + 0 = x exactly off the image rows


def _stacked(deepstack, merged):  # [f32[n,D]] * K, f32[n,D] -> f32[n,K,D]
    """The tower's deepstack features with the image token first (padded and gathered alike with image_embeds)."""
    return torch.stack(deepstack, dim=1) if deepstack else merged.new_zeros(merged.shape[0], 0, merged.shape[1])


def _check_image_keywords(image_embeds, deepstack_embeds):
    """Qwen3-VL's image rows need both parts: merged patches without their deepstack features (or the reverse)
    would run a different model silently."""
    if (image_embeds is None) != (deepstack_embeds is None):
        raise ValueError("Qwen3-VL takes image_embeds and deepstack_embeds together (encode_images gives both)")


# ---- modules --------------------------------------------------------------------------------

class Qwen3VLTextModel(nn.Module):
    """Qwen3's decoder stack under interleaved M-RoPE, fed embeddings (the image rows already merged in); deepstack
    feature k joins the image rows after layer k."""

    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        t = config.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(t) for _ in range(t.num_hidden_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)

    def forward(self, embeds, inputs: LayerInputs, visual_pos_masks=None, deepstack_visual_embeds=(),
                check_count: bool = True):
        """embeds f32[B,T,D], visual_pos_masks bool[B,T], deepstack_visual_embeds [f32[n,D]] -> f32[B,T,D]."""
        for k, layer in enumerate(self.layers):
            embeds = layer(embeds, inputs)
            if k < len(deepstack_visual_embeds):
                embeds = add_deepstack(embeds, visual_pos_masks, deepstack_visual_embeds[k], check_count)
        return self.norm(embeds)


class Qwen3VLModel(nn.Module):
    """transformers' Qwen3VLModel: the tower (`visual`) and the language model (`language_model`), to hidden states."""

    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        self.config = config
        self.visual = Qwen3VisionTransformer(config.vision)
        self.language_model = Qwen3VLTextModel(config)

    def encode_images(self, pixel_values, image_grid_thw):
        """f32[P, C*2*16*16], i64[I,3] -> {image_embeds f32[P/4,D], deepstack_embeds f32[P/4,K,D]}."""
        merged, deepstack = self.visual(pixel_values, image_grid_thw)
        return {"image_embeds": merged, "deepstack_embeds": _stacked(deepstack, merged)}

    def forward(self, input_ids, attention_mask, position_ids, pixel_values=None, image_grid_thw=None,
                image_embeds=None, deepstack_embeds=None):
        """i64[B,T], i64[B,T], i64[3,B,T], f32[P, C*2*16*16], i64[I,3] (or encode_images' two tensors) -> the final
        hidden states f32[B,T,D]."""
        c = self.config
        if pixel_values is not None:
            features = self.encode_images(pixel_values, image_grid_thw)
            image_embeds, deepstack_embeds = features["image_embeds"], features["deepstack_embeds"]
        _check_image_keywords(image_embeds, deepstack_embeds)
        inputs = layer_inputs(c, attention_mask, position_ids)
        embeds = self.language_model.embed_tokens(input_ids)
        if image_embeds is None:
            return self.language_model(embeds, inputs)
        embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id)
        return self.language_model(embeds, inputs, input_ids == c.image_token_id, deepstack_embeds.unbind(1))


class Qwen3VLForConditionalGeneration(nn.Module):
    """The release's module tree: `model.language_model`, `model.visual`, `lm_head` (the embedding when tied)."""

    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3VLModel(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def rope_index(self, input_ids, image_grid_thw, attention_mask):  # -> i64[3,B,T], i64[B,1]
        c = self.config
        types = mrope.token_types(input_ids, image_token_id=c.image_token_id, video_token_id=c.video_token_id)
        return mrope.get_rope_index(input_ids, image_grid_thw, attention_mask, mm_token_type_ids=types,
                                    spatial_merge_size=c.vision.spatial_merge_size)

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed_tokens(input_ids)

    def encode_images(self, pixel_values, image_grid_thw):
        """The forward's image keywords: {image_embeds f32[n,D], deepstack_embeds f32[n,K,D]}, the tower's output
        (frozen under LoRA, so a trainer may compute it once per batch)."""
        return self.model.encode_images(pixel_values, image_grid_thw)

    def forward(self, input_ids, attention_mask=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                return_hidden: bool = False, image_embeds=None, deepstack_embeds=None):
        """input_ids i64[B,T], attention_mask i64[B,T], position_ids i64[3,B,T] (None: the rope index of the
        batch, as LLaMA-Factory's collator computes it), pixel_values f32[P, C*2*16*16], image_grid_thw
        i64[I,3] (or image_embeds f32[n,D] and deepstack_embeds f32[n,K,D], encode_images' output) -> logits
        f32[B,T,V] (and the final hidden states with return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids, _ = self.rope_index(input_ids, image_grid_thw, attention_mask)
        hidden = self.model(input_ids, attention_mask, position_ids, pixel_values, image_grid_thw, image_embeds,
                            deepstack_embeds)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout), fp32, eval mode."""
        return load_pretrained(cls, Qwen3VLConfig.from_pretrained(path), path)
