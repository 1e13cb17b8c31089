"""LLaVA-NeXT (LLaVA-1.6) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers 5.24's modeling_llava_next.py: a CLIP tower (models/clip.py) reads every tile of an image ("anyres":
the base image, then the tiles of the image fitted into its best grid pinpoint; models/llava_next_processing.py) and
its hidden states at `vision_feature_layer` (-2: the input of the last block), the CLS dropped ("default"), go
through the projector (linear_1, GELU, linear_2). Per image, the tiles' features are regridded into one
(rows * side, cols * side) map, the padding the processor added is cropped back off (`unpad_image`), the learned
`image_newline` is appended to every row, and the base tile's features go first: [base, grid rows with newlines],
whose rows replace the `<image>` tokens in reading order (masked_scatter). The language model is Llama (the
models/llama3.py blocks; vicuna's default RoPE), positions 0..T-1 as transformers numbers a right-padded batch.

Training and inference run the same numbers here: no token_type_ids, the causal + padding mask either way
(LLaMA-Factory trains it right-padded with labels, train mode, dropout 0).

Module tree: transformers 5's in-memory one (`model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.image_newline`, `model.language_model.*`, `lm_head`), so LoRA names equal PEFT's on the HF model. The
release stores `vision_tower.vision_model.*`, `language_model.model.*`, `language_model.lm_head.weight`,
`multi_modal_projector.*`, `image_newline`: `_module_name` maps those (and transformers 5's own save layouts) in.

The tower's output may also come precomputed (a LoRA trainer runs the frozen tower and projector once per batch):
`encode_images` gives `image_embeds` f32[n,D], the rows in reading order over all images of the batch;
`model(ids, mask, image_embeds=model.encode_images(px, sizes))` is `model(ids, mask, px, sizes)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import llama3
from torch_sources.models.clip import CLIPVisionConfig, CLIPVisionModel
from torch_sources.models.config_keys import ConfigError, KeyAudit
from torch_sources.models.layers import ACTIVATIONS, LayerInputs, RMSNorm, apply_rope, rope_cos_sin
from torch_sources.models.llama3 import LlamaConfig, LlamaDecoderLayer
from torch_sources.models.llava_next_processing import select_best_resolution, unpadded_grid
from torch_sources.models.loading import iter_tensors, load_config
from torch_sources.models.qwen2_vl import LanguageModelView, merge_image_embeddings

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
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def rope_inv_freq(config: LlavaNextConfig):  # -> f32[hd/2]: the language model's table (models/llama3.py)
    return llama3.rope_inv_freq(config.text)


def layer_inputs(config: LlavaNextConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Causal + padding mask and Llama's RoPE cos/sin (positions 0..T-1 unless given) every layer shares."""
    return llama3.layer_inputs(config.text, attention_mask, position_ids)


# ---- checkpoint names -----------------------------------------------------------------------

# release prefix -> module prefix (the first that matches); names already in the in-memory layout pass through
_RENAMES = [(r"language_model\.lm_head\.", "lm_head."),
            (r"language_model\.model\.", "model.language_model."),
            (r"(vision_tower|multi_modal_projector|image_newline)", r"model.\1")]


def _module_name(name: str) -> str:
    """A checkpoint tensor's name in this module tree: the release's `language_model.model.*`,
    `vision_tower.vision_model.*`, ... (transformers 5 drops CLIPVisionModel's `vision_model.` on load, as here)."""
    for prefix, target in _RENAMES:
        if re.match(prefix, name):
            name = re.sub("^" + prefix, target, name)
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


# ---- anyres bookkeeping (host side: a function of image_sizes only) --------------------------

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
    grid = features[1:].reshape(rows, cols, side, side, D).permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, D)
    top, bottom, left, right = unpadded_grid(image_size, rows * side, cols * side)
    grid = grid[top:bottom, left:right]
    newline = image_newline.to(grid.dtype).expand(grid.shape[0], 1, D)
    return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, D)])


# ---- modules --------------------------------------------------------------------------------

class LlavaNextMultiModalProjector(nn.Module):
    def __init__(self, config: LlavaNextConfig):
        super().__init__()
        bias, D = config.multimodal_projector_bias, config.text.hidden_size
        self.act = ACTIVATIONS[config.projector_hidden_act]
        self.linear_1 = nn.Linear(config.vision.hidden_size, D, bias=bias)
        self.linear_2 = nn.Linear(D, D, bias=bias)

    def forward(self, x):  # f32[..., E] -> f32[..., D]
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaNextTextModel(nn.Module):
    """Llama's decoder stack fed embeddings (the image rows already merged in): transformers' LlamaModel."""

    def __init__(self, config: LlavaNextConfig):
        super().__init__()
        t = config.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(t) for _ in range(t.num_hidden_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)

    def forward(self, embeds, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class LlavaNextModel(nn.Module):
    """transformers' LlavaNextModel: the tower, the projector, the newline and the language model, to hidden states."""

    def __init__(self, config: LlavaNextConfig):
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionModel(config.vision)
        self.multi_modal_projector = LlavaNextMultiModalProjector(config)
        self.image_newline = nn.Parameter(torch.empty(config.text.hidden_size))
        self.language_model = LlavaNextTextModel(config)

    def encode_images(self, pixel_values, image_sizes):
        """pixel_values f32[I, tiles, C, S, S] (each image's stack padded with unread tiles past its count),
        image_sizes i64[I, 2] -> f32[n, D]: every image's packed rows, in order."""
        c = self.config
        sizes = [tuple(s) for s in torch.as_tensor(image_sizes).tolist()]
        counts = [image_num_tiles(s, c) for s in sizes]
        tiles = torch.cat([px[:n] for px, n in zip(pixel_values, counts)])
        hidden_states, _ = self.vision_tower(tiles)
        features = self.multi_modal_projector(hidden_states[c.vision_feature_layer][:, 1:])  # "default": CLS dropped
        return torch.cat([pack_image_features(f, s, c, self.image_newline)
                          for f, s in zip(features.split(counts), sizes)])

    def forward(self, input_ids, attention_mask, pixel_values=None, image_sizes=None, image_embeds=None,
                position_ids=None):
        """i64[B,T], i64[B,T], f32[I,tiles,C,S,S], i64[I,2] (or image_embeds f32[n,D]), i64[B,T] | None -> the final
        hidden states f32[B,T,D]."""
        c = self.config
        if pixel_values is not None:
            image_embeds = self.encode_images(pixel_values, image_sizes)
        embeds = self.language_model.embed_tokens(input_ids)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id)
        return self.language_model(embeds, layer_inputs(c, attention_mask, position_ids))


class LlavaNextForConditionalGeneration(nn.Module):
    """transformers 5's in-memory tree: `model.{vision_tower, multi_modal_projector, image_newline, language_model}`,
    `lm_head` (the embedding when tied)."""

    def __init__(self, config: LlavaNextConfig):
        super().__init__()
        self.config = config
        self.model = LlavaNextModel(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed_tokens(input_ids)

    def encode_images(self, pixel_values, image_sizes):
        """The rows that replace the image tokens, f32[n, D] (the frozen tower and projector under LoRA, so a
        trainer may compute them once per batch)."""
        return self.model.encode_images(pixel_values, image_sizes)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
                return_hidden: bool = False, image_embeds=None, position_ids=None):
        """input_ids i64[B,T], attention_mask i64[B,T], pixel_values f32[I, tiles, C, S, S], image_sizes i64[I,2]
        (or image_embeds f32[n,D], encode_images' output), position_ids i64[B,T] (None: 0..T-1, transformers' for a
        right-padded batch) -> logits f32[B,T,V] (and the final hidden states with return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, pixel_values, image_sizes, image_embeds, position_ids)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout, or transformers 5's), fp32, eval mode."""
        config = LlavaNextConfig.from_pretrained(path)
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = cls(config)
        state = {_module_name(k): v.to(torch.float32) for k, v in iter_tensors(path)}
        embed = "model.language_model.embed_tokens.weight"
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state[embed])
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.get_parameter(embed)
        return model.eval()
