"""Qwen3-VL in Flax Linen: the torch-free twin of torch_sources/models/qwen3_vl.py.

A Qwen3 language model (models/qwen3.py blocks) under interleaved M-RoPE (models/mrope.py), fed by the Qwen3-VL
tower (models/vision.py), whose deepstack features join the image rows after the first decoder layers. Same
public names in the same order; params named after the HF checkpoint (`model/language_model/...`,
`model/visual/...`; see conversion/qwen3_vl.py). The image grid is static host data, as everything the tower
derives from it; the rope index is host numpy too (data-dependent), so a jitted caller passes position_ids.

The tower's output may also come precomputed (a LoRA trainer runs the frozen tower once per batch, outside its
jitted step): `encode_images` gives the forward's image keywords, `image_embeds` f32[n,D] (the merged patches) and
`deepstack_embeds` f32[n,K,D] (row k: the K deepstack features of the k-th image token), both indexed by image
token on axis 0 so a caller pads them alike; `model(ids, mask, pos, **model.encode_images(px, grid))` is
`model(ids, mask, pos, px, grid)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.models import mrope, rope
from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import LayerInputs, RMSNorm, causal_mask
from jax_oracles.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from jax_oracles.models.qwen3 import Qwen3Config, Qwen3DecoderLayer
from jax_oracles.models.vision import Qwen3VisionTransformer, Qwen3VLVisionConfig

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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---- operators ------------------------------------------------------------------------------

def layer_inputs(config: Qwen3VLConfig, attention_mask, position_ids) -> LayerInputs:
    """Causal + padding mask and the interleaved M-RoPE cos/sin (position_ids i32[3,B,T]) every layer shares."""
    cos, sin = mrope.mrope_cos_sin(rope.inv_freq(config.text.rope), position_ids, config.mrope_section,
                                   interleaved=True)
    return LayerInputs(causal_mask(attention_mask), cos, sin)


def add_deepstack(hidden, visual_pos_masks, visual_embeds, check_count: bool = True):
    """f32[B,T,D], bool[B,T], f32[n,D] -> f32[B,T,D]: the n visual rows, in reading order, plus one deepstack
    feature each (transformers' `_deepstack_process`); every other row unchanged. The counts are checked where
    the mask is concrete (check_count=False: visual_embeds may carry rows past them, never read)."""
    if (check_count and not _traced(visual_pos_masks)
            and int(np.asarray(visual_pos_masks).sum()) != visual_embeds.shape[0]):
        raise ValueError(f"deepstack features and image tokens do not match: {int(np.asarray(visual_pos_masks).sum())} "
                         f"tokens, {visual_embeds.shape[0]} features")
    B, T, D = hidden.shape
    order = jnp.clip(jnp.cumsum(visual_pos_masks.reshape(-1)) - 1, 0, visual_embeds.shape[0] - 1)  # k-th row <- k
    added = jnp.where(visual_pos_masks[..., None], visual_embeds[order].reshape(B, T, D).astype(hidden.dtype), 0.0)
    return hidden + added  # x + 0 = x exactly off the image rows


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _stacked(deepstack, merged):  # [f32[n,D]] * K, f32[n,D] -> f32[n,K,D]
    """The tower's deepstack features with the image token first (padded alike with image_embeds)."""
    return jnp.stack(deepstack, axis=1) if deepstack else jnp.zeros((merged.shape[0], 0, merged.shape[1]), merged.dtype)


def _check_image_keywords(image_embeds, deepstack_embeds):
    """Qwen3-VL's image rows need both parts: merged patches without their deepstack features (or the reverse)
    would run a different model silently."""
    if (image_embeds is None) != (deepstack_embeds is None):
        raise ValueError("Qwen3-VL takes image_embeds and deepstack_embeds together (encode_images gives both)")


# ---- modules --------------------------------------------------------------------------------

class Qwen3VLTextModel(nn.Module):
    """Qwen3's decoder stack under interleaved M-RoPE, fed embeddings (the image rows already merged in); deepstack
    feature k joins the image rows after layer k."""
    config: Qwen3VLConfig
    lora_scaling: float = 2.0

    def setup(self):
        t = self.config.text
        self.embed_tokens = nn.Embed(t.vocab_size, t.hidden_size)
        self.layers = [Qwen3DecoderLayer(t, self.lora_scaling, name=f"layers_{i}") for i in range(t.num_hidden_layers)]
        self.norm = RMSNorm(t.rms_norm_eps)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]
        return self.embed_tokens(input_ids)

    def __call__(self, embeds, inputs: LayerInputs, visual_pos_masks=None, deepstack_visual_embeds=(),
                 check_count: bool = True):
        """embeds f32[B,T,D], visual_pos_masks bool[B,T], deepstack_visual_embeds [f32[n,D]] -> f32[B,T,D]."""
        for k, layer in enumerate(self.layers):
            embeds = layer(embeds, inputs)
            if k < len(deepstack_visual_embeds):
                embeds = add_deepstack(embeds, visual_pos_masks, deepstack_visual_embeds[k], check_count)
        return self.norm(embeds)


class Qwen3VLModel(nn.Module):
    """transformers' Qwen3VLModel: the tower (`visual`) and the language model (`language_model`), to hidden states."""
    config: Qwen3VLConfig
    lora_scaling: float = 2.0

    def setup(self):
        self.visual = Qwen3VisionTransformer(self.config.vision)
        self.language_model = Qwen3VLTextModel(self.config, self.lora_scaling)

    def encode_images(self, pixel_values, image_grid_thw):
        """f32[P, C*2*16*16], (host) [I,3] -> {image_embeds f32[P/4,D], deepstack_embeds f32[P/4,K,D]}."""
        merged, deepstack = self.visual(pixel_values, image_grid_thw)
        return {"image_embeds": merged, "deepstack_embeds": _stacked(deepstack, merged)}

    def __call__(self, input_ids, attention_mask, position_ids, pixel_values=None, image_grid_thw=None,
                 image_embeds=None, deepstack_embeds=None):
        """i32[B,T], i32[B,T], i32[3,B,T], f32[P, C*2*16*16], (host) [I,3] (or encode_images' two arrays, rows past
        the image tokens' count never read) -> the final hidden states f32[B,T,D]."""
        c = self.config
        exact = pixel_values is not None  # the tower's own rows: their count is checked; precomputed ones may be padded
        if exact:
            features = self.encode_images(pixel_values, image_grid_thw)
            image_embeds, deepstack_embeds = features["image_embeds"], features["deepstack_embeds"]
        _check_image_keywords(image_embeds, deepstack_embeds)
        inputs = layer_inputs(c, attention_mask, position_ids)
        embeds = self.language_model.embed(input_ids)
        if image_embeds is None:
            return self.language_model(embeds, inputs)
        embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id, check_count=exact)
        deepstack = [deepstack_embeds[:, k] for k in range(deepstack_embeds.shape[1])]
        return self.language_model(embeds, inputs, input_ids == c.image_token_id, deepstack, check_count=exact)


class Qwen3VLForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, position_ids,
    pixel_values, image_grid_thw); the release's tree: `model/language_model`, `model/visual`, `lm_head`."""
    config: Qwen3VLConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def rope_index(self, input_ids, image_grid_thw, attention_mask):  # host numpy -> i64[3,B,T], i64[B,1]
        c = self.config
        types = mrope.token_types(input_ids, image_token_id=c.image_token_id, video_token_id=c.video_token_id)
        return mrope.get_rope_index(input_ids, image_grid_thw, attention_mask, mm_token_type_ids=types,
                                    spatial_merge_size=c.vision.spatial_merge_size)

    def setup(self):
        c = self.config
        self.model = Qwen3VLModel(c, self.lora_scaling)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed(input_ids)

    def encode_images(self, pixel_values, image_grid_thw):
        """The forward's image keywords: {image_embeds f32[n,D], deepstack_embeds f32[n,K,D]}, the frozen tower's
        output (a trainer computes it once per batch, outside its jitted step)."""
        return self.model.encode_images(pixel_values, image_grid_thw)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                 return_hidden: bool = False, image_embeds=None, deepstack_embeds=None):
        """input_ids i32[B,T], attention_mask i32[B,T], position_ids i32[3,B,T] (None: the rope index, on the
        host), pixel_values f32[P, C*2*16*16], image_grid_thw (host) [I,3] (or image_embeds f32[n,D] and
        deepstack_embeds f32[n,K,D], encode_images' output; rows past the image tokens' count are never read)
        -> logits f32[B,T,V]."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if position_ids is None:
            if _traced(input_ids) or _traced(attention_mask):
                raise TypeError("position_ids are needed under jit: the rope index is host numpy "
                                "(Qwen3VLForConditionalGeneration.rope_index)")
            position_ids, _ = self.rope_index(np.asarray(input_ids), image_grid_thw, np.asarray(attention_mask))
        hidden = self.model(input_ids, attention_mask, position_ids, pixel_values, image_grid_thw, image_embeds,
                            deepstack_embeds)
        if c.tie_word_embeddings:  # Qwen3-VL-2B / 4B: the embedding doubles as the output head
            logits = hidden @ self.variables["params"]["model"]["language_model"]["embed_tokens"]["embedding"].T
        else:
            logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
