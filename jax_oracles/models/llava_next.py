"""LLaVA-NeXT (LLaVA-1.6) in Flax Linen: the torch-free twin of torch_sources/models/llava_next.py (see its docstring).

Same public names in the same order; params named like the torch module tree (`model/vision_tower/...`,
`model/multi_modal_projector/...`, `model/image_newline`, `model/language_model/...`, `lm_head`; see
conversion/llava_next.py). image_sizes are static host data, as everything derived from them (each image's tile
count, grid and unpadding crop): one compile per set of image sizes, pixel_values traced. The language model's
projections are LoraLinear (the "lora" collection reaches them); the tower and the projector are plain Dense,
frozen under LLaMA-Factory's defaults.

The tower's output may also come precomputed (a LoRA trainer runs it once per batch, outside its jitted step):
`encode_images` gives `image_embeds` f32[n,D]; rows past the image tokens' count are never read, so a caller may pad
them to a static count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.models import llama3
from jax_oracles.models.clip import CLIPVisionConfig, CLIPVisionModel
from jax_oracles.models.config_keys import ConfigError, KeyAudit
from jax_oracles.models.layers import ACTIVATIONS, LayerInputs, RMSNorm, apply_rope, rope_cos_sin
from jax_oracles.models.llama3 import LlamaConfig, LlamaDecoderLayer
from jax_oracles.models.llava_next_processing import select_best_resolution, unpadded_grid
from jax_oracles.models.qwen2_vl import LanguageModelView, merge_image_embeddings

AUTO_MODEL = ("llava_next", "LlavaNextForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "LLAMA_DEFAULTS", "LlavaNextConfig", "read_text_config",
    "rope_inv_freq", "rope_cos_sin", "apply_rope", "layer_inputs",
    "anyres_grid_shape", "image_num_tiles", "num_image_features", "pack_image_features", "merge_image_embeddings",
    "LlavaNextMultiModalProjector", "LlavaNextTextModel", "LlavaNextModel", "LlavaNextForConditionalGeneration",
]

# text_config: Llama's keys (models/llama3.py), the tie read from the top level instead.
TEXT_KEYS = KeyAudit(
    "llava_next text",
    honored=llama3.CONFIG_KEYS.honored - {"tie_word_embeddings"},
    ignored={**llama3.CONFIG_KEYS.ignored,
             "tie_word_embeddings": "transformers ties on the top-level key only (LlavaNextConfig's)"},
    refused=dict(llama3.CONFIG_KEYS.refused))

# The top level (LlavaNextConfig), plus what the llava-hf 4.39 releases wrote beside it.
CONFIG_KEYS = KeyAudit(
    "llava_next",
    honored=frozenset({"text_config", "vision_config", "image_token_index", "image_grid_pinpoints",
                       "vision_feature_layer", "projector_hidden_act", "multimodal_projector_bias",
                       "tie_word_embeddings"}),
    ignored={"image_seq_length": "LLaVA-1.5's fixed count; LLaVA-NeXT's follows image_sizes (the processor's count)",
             "ignore_index": "the label id transformers 4.x's loss skipped; the loss is the trainer's",
             "vocab_size": "transformers 4.39's copy of text_config.vocab_size; the language model reads text_config's"},
    refused={"vision_feature_select_strategy": (("default",), "the anyres regrid needs the CLS dropped ('full' keeps "
                                                "it and transformers' view fails)"),
             "use_image_newline_parameter": ((True,), "transformers 5 always appends the learned image_newline")})

# transformers' LlamaConfig defaults: the vicuna release's text_config states only what differs.
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}


def read_text_config(d: dict, tie_word_embeddings: bool) -> LlamaConfig:
    """The language model's LlamaConfig from text_config (either RoPE form; absent keys at LlamaConfig's defaults,
    num_key_value_heads defaulting to the heads)."""
    TEXT_KEYS.check(d)
    if d.get("model_type", "llama") != "llama":
        raise ConfigError(f"llava_next config: text_config model_type {d['model_type']!r} (only the Llama language "
                          f"model, the vicuna release's, is composed here)")
    d = {**LLAMA_DEFAULTS, **{k: v for k, v in d.items() if k != "tie_word_embeddings"}}
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    return LlamaConfig.from_hf({**d, "tie_word_embeddings": tie_word_embeddings})


@dataclass(frozen=True)
class LlavaNextConfig(LanguageModelView):
    text: LlamaConfig
    vision: CLIPVisionConfig
    image_grid_pinpoints: tuple[tuple[int, int], ...]
    image_token_id: int = 32000
    vision_feature_layer: int = -2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "LlavaNextConfig":
        """Either form of config.json: the release's (sparse text_config with rope_theta or none, the 4.39 extras) or
        what transformers 5's save_pretrained writes (every key, text_config.rope_parameters)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"llava_next config: no {key} (LLaVA-NeXT nests both towers' keys)")
        layer = d.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(f"llava_next config: vision_feature_layer={layer!r} (one layer index; no release "
                              f"concatenates several)")
        act = d.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"llava_next config: projector_hidden_act {act!r} is not one of {sorted(ACTIVATIONS)}")
        vision = CLIPVisionConfig.from_hf(d["vision_config"])
        if not -vision.num_hidden_layers - 1 <= layer <= vision.num_hidden_layers:
            raise ConfigError(f"llava_next config: vision_feature_layer={layer} indexes none of the tower's "
                              f"{vision.num_hidden_layers + 1} hidden states")
        pinpoints = tuple(tuple(int(s) for s in p) for p in d.get("image_grid_pinpoints") or
                          [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
        if any(s % vision.image_size for p in pinpoints for s in p):
            raise ConfigError(f"llava_next config: image_grid_pinpoints {pinpoints} must be multiples of the tower's "
                              f"image_size {vision.image_size} (transformers' regrid view fails otherwise)")
        tie = bool(d.get("tie_word_embeddings", False))
        return cls(text=read_text_config(d["text_config"], tie), vision=vision, image_grid_pinpoints=pinpoints,
                   image_token_id=int(d.get("image_token_index", 32000)), vision_feature_layer=layer,
                   projector_hidden_act=act, multimodal_projector_bias=bool(d.get("multimodal_projector_bias", True)),
                   tie_word_embeddings=tie)

    @classmethod
    def from_pretrained(cls, path) -> "LlavaNextConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---- operators ------------------------------------------------------------------------------

def rope_inv_freq(config: LlavaNextConfig):  # -> f32[hd/2]: the language model's table (models/llama3.py)
    return llama3.rope_inv_freq(config.text)


def layer_inputs(config: LlavaNextConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Causal + padding mask and Llama's RoPE cos/sin (positions 0..T-1 unless given) every layer shares."""
    return llama3.layer_inputs(config.text, attention_mask, position_ids)


# ---- anyres bookkeeping (host side: a function of image_sizes only) --------------------------

def _host_sizes(image_sizes) -> list[tuple[int, int]]:
    if isinstance(image_sizes, jax.core.Tracer):
        raise TypeError("image_sizes must be concrete host data: every image's tiles and crop follow from them")
    return [(int(h), int(w)) for h, w in np.asarray(image_sizes).tolist()]


def anyres_grid_shape(image_size, config: LlavaNextConfig) -> tuple[int, int]:
    """(rows, cols) of tiles the processor cut the (h, w) image into: its best pinpoint over the tower's side."""
    h, w = select_best_resolution(image_size, config.image_grid_pinpoints)
    return h // config.vision.image_size, w // config.vision.image_size


def image_num_tiles(image_size, config: LlavaNextConfig) -> int:  # the grid's tiles plus the base tile
    rows, cols = anyres_grid_shape(image_size, config)
    return rows * cols + 1


def num_image_features(image_size, config: LlavaNextConfig) -> int:
    """The rows pack_image_features gives the (h, w) image: the base tile's patches, then the unpadded grid with
    one newline per row (the `<image>` tokens it needs)."""
    side = config.vision.num_patches_per_side
    rows, cols = anyres_grid_shape(image_size, config)
    top, bottom, left, right = unpadded_grid(image_size, rows * side, cols * side)
    return side * side + (bottom - top) * (right - left + 1)


def pack_image_features(features, image_size, config: LlavaNextConfig, image_newline):
    """f32[tiles, side*side, D] (one image's projected tile features, base first), (h, w), f32[D] -> f32[n, D]:
    the base tile's rows, then the tiles regridded into one (rows*side, cols*side) map, cropped to the image's own
    aspect (unpad_image), a newline row appended to each map row, read row-major (pack_image_features)."""
    side = config.vision.num_patches_per_side
    rows, cols = anyres_grid_shape(image_size, config)
    D = features.shape[-1]
    grid = features[1:].reshape(rows, cols, side, side, D).transpose(0, 2, 1, 3, 4).reshape(rows * side, cols * side, D)
    top, bottom, left, right = unpadded_grid(image_size, rows * side, cols * side)
    grid = grid[top:bottom, left:right]
    newline = jnp.broadcast_to(image_newline.astype(grid.dtype), (grid.shape[0], 1, D))
    return jnp.concatenate([features[0], jnp.concatenate([grid, newline], axis=1).reshape(-1, D)])


# ---- modules --------------------------------------------------------------------------------

class LlavaNextMultiModalProjector(nn.Module):
    config: LlavaNextConfig

    @nn.compact
    def __call__(self, x):  # f32[..., E] -> f32[..., D]
        c = self.config
        D, bias = c.text.hidden_size, c.multimodal_projector_bias
        x = ACTIVATIONS[c.projector_hidden_act](nn.Dense(D, use_bias=bias, name="linear_1")(x))
        return nn.Dense(D, use_bias=bias, name="linear_2")(x)


class LlavaNextTextModel(nn.Module):
    """Llama's decoder stack fed embeddings (the image rows already merged in): transformers' LlamaModel."""
    config: LlavaNextConfig
    lora_scaling: float = 2.0

    def setup(self):
        t = self.config.text
        self.embed_tokens = nn.Embed(t.vocab_size, t.hidden_size)
        self.layers = [LlamaDecoderLayer(t, self.lora_scaling, name=f"layers_{i}") for i in range(t.num_hidden_layers)]
        self.norm = RMSNorm(t.rms_norm_eps)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]
        return self.embed_tokens(input_ids)

    def __call__(self, embeds, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class LlavaNextModel(nn.Module):
    """transformers' LlavaNextModel: the tower, the projector, the newline and the language model, to hidden states."""
    config: LlavaNextConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.vision_tower = CLIPVisionModel(c.vision)
        self.multi_modal_projector = LlavaNextMultiModalProjector(c)
        self.image_newline = self.param("image_newline", nn.initializers.normal(c.text.hidden_size ** -0.5),
                                        (c.text.hidden_size,), jnp.float32)
        self.language_model = LlavaNextTextModel(c, self.lora_scaling)

    def encode_images(self, pixel_values, image_sizes):
        """pixel_values f32[I, tiles, C, S, S] (each image's stack padded with unread tiles past its count),
        image_sizes (host) [I, 2] -> f32[n, D]: every image's packed rows, in order."""
        c = self.config
        sizes = _host_sizes(image_sizes)
        counts = [image_num_tiles(s, c) for s in sizes]
        tiles = jnp.concatenate([pixel_values[i, :n] for i, n in enumerate(counts)])
        hidden_states, _ = self.vision_tower(tiles)
        features = self.multi_modal_projector(hidden_states[c.vision_feature_layer][:, 1:])  # "default": CLS dropped
        starts = np.cumsum([0, *counts])
        return jnp.concatenate([pack_image_features(features[a:b], s, c, self.image_newline)
                                for a, b, s in zip(starts[:-1], starts[1:], sizes)])

    def __call__(self, input_ids, attention_mask, pixel_values=None, image_sizes=None, image_embeds=None,
                 position_ids=None):
        """i32[B,T], i32[B,T], f32[I,tiles,C,S,S], (host) [I,2] (or image_embeds f32[n,D], rows past the image tokens'
        count never read), i32[B,T] | None -> the final hidden states f32[B,T,D]."""
        c = self.config
        exact = pixel_values is not None  # the tower's own rows: their count is checked; precomputed ones may be padded
        if exact:
            image_embeds = self.encode_images(pixel_values, image_sizes)
        embeds = self.language_model.embed(input_ids)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id, check_count=exact)
        return self.language_model(embeds, layer_inputs(c, attention_mask, position_ids))


class LlavaNextForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, pixel_values,
    image_sizes); the tree: `model/{vision_tower, multi_modal_projector, image_newline, language_model}`, `lm_head`."""
    config: LlavaNextConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        c = self.config
        self.model = LlavaNextModel(c, self.lora_scaling)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed(input_ids)

    def encode_images(self, pixel_values, image_sizes):
        """The rows that replace the image tokens, f32[n, D] (the frozen tower and projector: a trainer computes them
        once per batch, outside its jitted step)."""
        return self.model.encode_images(pixel_values, image_sizes)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
                 return_hidden: bool = False, image_embeds=None, position_ids=None):
        """input_ids i32[B,T], attention_mask i32[B,T], pixel_values f32[I, tiles, C, S, S], image_sizes (host) [I,2]
        (or image_embeds f32[n,D], encode_images' output), position_ids i32[B,T] (None: 0..T-1) -> logits
        f32[B,T,V] (and the final hidden states with return_hidden)."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, pixel_values, image_sizes, image_embeds, position_ids)
        if c.tie_word_embeddings:
            logits = hidden @ self.variables["params"]["model"]["language_model"]["embed_tokens"]["embedding"].T
        else:
            logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
