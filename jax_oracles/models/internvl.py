"""InternVL (the "-hf" releases, model_type internvl) in Flax Linen: the torch-free twin of
torch_sources/models/internvl.py.

The InternViT tower (models/intern_vit.py), transformers' pixel shuffle at ratio 0.5 and the LayerNorm-Linear-GELU-
Linear projector feed a Qwen2 language model (models/qwen2.py's blocks, plain RoPE); the projected tiles replace the
`<IMG_CONTEXT>` tokens' embeddings in reading order. Same public names in the same order; params named after
transformers 5's in-memory tree (`model/vision_tower/...`, `model/multi_modal_projector/...`,
`model/language_model/...`, `lm_head` when untied; conversion/internvl.py maps the release's stored names onto it).

The tower's output may also come precomputed (a LoRA trainer runs the frozen tower once per batch, outside its
jitted step): `encode_images` gives `image_embeds` f32[n,D], indexed by image token; rows past the image tokens'
count are never read, so a caller may pad it to a static size.
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models import qwen2
from jax_oracles.models.config_keys import BOOKKEEPING, ConfigError, KeyAudit
from jax_oracles.models.intern_vit import InternVLVisionConfig, InternVLVisionModel
from jax_oracles.models.layers import ACTIVATIONS, LayerInputs, LayerNorm, apply_rope, rope_cos_sin
from jax_oracles.models.qwen2 import Qwen2Config
from jax_oracles.models.qwen2_vl import LanguageModelView, Qwen2VLTextModel, merge_image_embeddings

AUTO_MODEL = ("internvl", "InternVLForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_EXTRA_KEYS", "TEXT_MODEL_TYPES", "PROJECTOR_LN_EPS", "InternVLConfig", "in_memory_name",
    "rope_inv_freq", "rope_cos_sin", "apply_rope", "layer_inputs", "merge_image_embeddings", "pixel_shuffle",
    "InternVLMultiModalProjector", "InternVLModel", "InternVLForConditionalGeneration",
]

PROJECTOR_LN_EPS = 1e-5  # nn.LayerNorm's default: transformers passes no eps to the projector's norm

CONFIG_KEYS = KeyAudit(
    "internvl",
    honored=frozenset({"text_config", "vision_config", "image_token_id", "downsample_ratio", "projector_hidden_act",
                       "vision_feature_layer", "tie_word_embeddings"}),
    ignored={"image_seq_length": "the processor's tokens per tile; the forward counts the image tokens"},
    refused={"vision_feature_select_strategy": (("default",), "'full' keeps CLS, whose 1 + h*w tokens transformers' "
                                                              "pixel shuffle cannot lay on a square grid")})
# text_config keys the Qwen2 audit (models/qwen2.py CONFIG_KEYS) does not list, read or set aside here first.
TEXT_EXTRA_KEYS = KeyAudit(
    "internvl text",
    honored=frozenset(),
    ignored={"_attn_implementation_autoset": "which attention kernel transformers 4.x picked; eager here",
             "tie_word_embeddings": "transformers 5 ties on the top-level key only (the releases repeat it here)"})
TEXT_MODEL_TYPES = ("qwen2",)  # the InternVL2.5/3 -hf releases' language model (Qwen2.5); no other is composed here


def in_memory_name(name: str) -> str:
    """A stored tensor name -> the module tree's (transformers 5's in-memory names, which load unchanged)."""
    for saved, live in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                        ("vision_tower.", "model.vision_tower."),
                        ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(saved):
            return live + name[len(saved):]
    return name


@dataclass(frozen=True)
class InternVLConfig(LanguageModelView):
    text: Qwen2Config
    vision: InternVLVisionConfig
    image_token_id: int = 151667
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int = -1
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, d: dict) -> "InternVLConfig":
        """Either form of config.json: the release's (transformers 4.52 wrote it: text_config with rope_theta,
        the original InternViT keys in vision_config, no top-level tie) or transformers 5's save_pretrained form
        (text_config.rope_parameters and layer_types, the top-level tie). The tie is the config's; a checkpoint
        storing its own head unties it (untied, applied by the loaders)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"internvl config: no {key} (InternVL nests both towers' keys)")
        text_d = dict(d["text_config"])
        if text_d.get("model_type", "qwen2") not in TEXT_MODEL_TYPES:
            raise ConfigError(f"internvl config not supported by this source: text_config.model_type="
                              f"{text_d['model_type']!r} (accepted: {TEXT_MODEL_TYPES}; InternVL3's language model)")
        TEXT_EXTRA_KEYS.check({k: text_d.pop(k) for k in list(text_d) if k in TEXT_EXTRA_KEYS.keys
                               and k not in BOOKKEEPING})
        tie = bool(d.get("tie_word_embeddings", True))  # transformers 5 reads the top level only (see untied)
        text = Qwen2Config.from_hf({**text_d, "tie_word_embeddings": tie})
        ratio = d.get("downsample_ratio", 0.5)
        if ratio != 0.5:
            raise ConfigError(f"internvl config not supported by this source: downsample_ratio={ratio!r} (accepted: "
                              f"0.5; every release shuffles 2x2 neighbours into one token)")
        act = d.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"internvl config: projector_hidden_act={act!r} (known: {sorted(ACTIVATIONS)})")
        layer = d.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(f"internvl config not supported by this source: vision_feature_layer={layer!r} (one "
                              f"layer index; a list concatenates layers, which no release does)")
        return cls(text=text, vision=InternVLVisionConfig.from_hf(d["vision_config"]),
                   image_token_id=int(d.get("image_token_id", 151667)), downsample_ratio=float(ratio),
                   projector_hidden_act=act, vision_feature_layer=layer, tie_word_embeddings=tie)

    @classmethod
    def from_pretrained(cls, path) -> "InternVLConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def untied(self) -> "InternVLConfig":
        """The same model with its own head: what transformers makes of a tying config (the top-level key, default
        True) whose checkpoint stores a head different from the embedding. The release has no top-level key (4.x
        tied on text_config's `false` and stored the head), and 5.x's save_pretrained writes True beside the
        untied head it kept: only the checkpoint can tell, so the loaders check it."""
        return dataclasses.replace(self, tie_word_embeddings=False,
                                   text=dataclasses.replace(self.text, tie_word_embeddings=False))

    @property
    def scale(self) -> int:  # 1 / downsample_ratio: the side of the neighbourhood one token absorbs
        return int(round(1 / self.downsample_ratio))

    @property
    def tokens_per_tile(self) -> int:  # (image / patch)^2 * ratio^2: image_seq_length
        v = self.vision
        return (v.image_size[0] // v.patch_size[0]) * (v.image_size[1] // v.patch_size[1]) // self.scale ** 2


# ---- operators ------------------------------------------------------------------------------

def rope_inv_freq(config: InternVLConfig):  # -> f32[hd/2]: the language model's table (models/qwen2.py)
    return qwen2.rope_inv_freq(config.text)


def layer_inputs(config: InternVLConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Causal + padding mask and Qwen2's RoPE cos/sin (positions 0..T-1 unless given) every layer shares."""
    return qwen2.layer_inputs(config.text, attention_mask, position_ids)


def pixel_shuffle(features, scale: int = 2):
    """f32[N,A,B,C] -> f32[N, A/s, B/s, C*s*s]: transformers' InternVLModel.pixel_shuffle at ratio 1/s (its axes
    named width, height): fold s neighbours along B into channels, swap the grid axes, fold s along A, swap back.
    The projector's weights were trained on this channel order, so it is kept step for step."""
    N, A, B, C = features.shape
    x = features.reshape(N, A, B // scale, C * scale).transpose(0, 2, 1, 3)
    x = x.reshape(N, B // scale, A // scale, C * scale * scale)
    return x.transpose(0, 2, 1, 3)


# ---- modules --------------------------------------------------------------------------------

class InternVLMultiModalProjector(nn.Module):
    config: InternVLConfig

    @nn.compact
    def __call__(self, x):  # f32[..., 4C] -> f32[..., D]
        c = self.config
        x = LayerNorm(PROJECTOR_LN_EPS, name="layer_norm")(x)
        x = ACTIVATIONS[c.projector_hidden_act](nn.Dense(c.text.hidden_size, name="linear_1")(x))
        return nn.Dense(c.text.hidden_size, name="linear_2")(x)


class InternVLModel(nn.Module):
    """transformers' InternVLModel: `vision_tower`, `multi_modal_projector`, `language_model` (Qwen2's stack)."""
    config: InternVLConfig
    lora_scaling: float = 2.0

    def setup(self):
        self.vision_tower = InternVLVisionModel(self.config.vision)
        self.multi_modal_projector = InternVLMultiModalProjector(self.config)
        self.language_model = Qwen2VLTextModel(self.config, self.lora_scaling)  # reads config.text only

    def encode_images(self, pixel_values):
        """f32[N,C,H,W] tiles -> f32[N*(H/p/s)*(W/p/s), D]: per tile, the feature layer's tokens without CLS on
        their grid, pixel-shuffled, projected; tiles in order, each tile's tokens row-major."""
        c = self.config
        x = self.vision_tower(pixel_values, c.vision_feature_layer)[:, 1:]  # strategy "default": CLS dropped
        N, L, E = x.shape
        side = int(L ** 0.5)  # transformers assumes a square grid (int(sqrt)): a non-square tile fails its reshape
        x = pixel_shuffle(x.reshape(N, side, side, E), c.scale)
        return self.multi_modal_projector(x.reshape(-1, x.shape[-1]))

    def __call__(self, input_ids, attention_mask, position_ids=None, pixel_values=None, image_embeds=None):
        """i32[B,T], i32[B,T], i32[B,T] | None, f32[N,C,H,W] | None (or image_embeds f32[n,D], rows past the image
        tokens' count never read) -> f32[B,T,D]."""
        c = self.config
        embeds = self.language_model.embed(input_ids)
        exact = pixel_values is not None  # the tower's own rows: their count is checked; precomputed ones may be padded
        if exact:
            image_embeds = self.encode_images(pixel_values)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id, check_count=exact)
        return self.language_model(embeds, layer_inputs(c, attention_mask, position_ids))


class InternVLForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, pixel_values);
    transformers 5's tree: `model/vision_tower`, `model/multi_modal_projector`, `model/language_model`, `lm_head`
    (the embedding when tied)."""
    config: InternVLConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        c = self.config
        self.model = InternVLModel(c, self.lora_scaling)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed(input_ids)

    def encode_images(self, pixel_values):  # f32[N,C,H,W] -> f32[N*tokens_per_tile, D]
        """The rows that replace the `<IMG_CONTEXT>` tokens, all tiles of the batch in order (the frozen tower's
        output: a trainer computes it once per batch, outside its jitted step)."""
        return self.model.encode_images(pixel_values)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, position_ids=None,
                 return_hidden: bool = False, image_embeds=None):
        """input_ids i32[B,T], attention_mask i32[B,T] (right padding), pixel_values f32[N,C,H,W] (or image_embeds
        f32[n,D], encode_images' output; rows past the image tokens' count are never read), position_ids i32[B,T]
        (None: 0..T-1) -> logits f32[B,T,V] (and the final hidden states with return_hidden)."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids, pixel_values, image_embeds)
        if c.tie_word_embeddings:
            logits = hidden @ self.variables["params"]["model"]["language_model"]["embed_tokens"]["embedding"].T
        else:
            logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
