"""PaliGemma (1) in Flax Linen: the torch-free twin of torch_sources/models/paligemma.py.

The Gemma 1 decoder (Gemma norms x_hat * (1 + w), GeGLU, MQA as configured, sqrt(hidden) embedding scale, tied
head), the SigLIP tower (models/siglip.py) and its one biased Linear projector, positions 1..T and the prefix-LM
mask from token_type_ids (see the torch file's docstring). Same public names in the same order; params named like
the torch module tree (`model/language_model/layers_<i>/...`, `model/vision_tower/...`,
`model/multi_modal_projector/linear`; conversion/paligemma.py maps the release's names). The decoder's projections
are LoraLinear layers, so adapters in a "lora" collection reach them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models import rope
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from jax_oracles.models.gemma3 import Gemma3RMSNorm as GemmaRMSNorm, _embed, gemma_rms_norm, rms_norm
from jax_oracles.models.layers import (ACTIVATIONS, GatedMLP, LayerInputs, apply_rope, attend, causal_mask,
                                      eager_attention, rope_cos_sin)
from jax_oracles.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from jax_oracles.models.siglip import SiglipVisionConfig, SiglipVisionModel
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("paligemma", "PaliGemmaForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "GemmaConfig", "PaliGemmaConfig",
    "gemma_rms_norm", "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "prefix_lm_mask", "layer_inputs", "merge_image_embeddings",
    "GemmaRMSNorm", "GemmaMLP", "GemmaAttention", "GemmaDecoderLayer", "GemmaTextModel",
    "PaliGemmaMultiModalProjector", "PaliGemmaModel", "PaliGemmaForConditionalGeneration",
]

TEXT_KEYS = KeyAudit(
    "paligemma text",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "attention_bias",
                       "max_position_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT,
             "hidden_activation": "the release's key; transformers 5.24's GemmaConfig reads hidden_act",
             "num_image_tokens": "PaliGemmaConfig writes it (patches per image); the decoder does not read it",
             "use_bidirectional_attention": "PaliGemma builds the mask itself; the flag only chooses SDPA's "
                                            "is_causal shortcut where no mask is given",
             "tie_word_embeddings": "transformers ties on the top-level key"})

CONFIG_KEYS = KeyAudit(
    "paligemma",
    honored=frozenset({"text_config", "vision_config", "image_token_index", "projection_dim", "tie_word_embeddings"}),
    ignored={"vocab_size": "PaliGemmaConfig's copy; the embedding is text_config.vocab_size",
             "hidden_size": "PaliGemmaConfig's copy; the decoder is text_config.hidden_size",
             "ignore_index": "the release's loss padding label; the forward does not read it"})


@dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: rope.Rope
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    pad_token_id: int | None = 0

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("paligemma text config: num_attention_heads is not a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, d: dict) -> "GemmaConfig":
        """GemmaConfig's defaults under the keys given (PaliGemma's sub-config defaults apply only when
        text_config is absent, which is refused)."""
        TEXT_KEYS.check(d)
        if d.get("model_type", "gemma") != "gemma":
            raise ConfigError(f"paligemma text config: model_type={d['model_type']!r} (PaliGemma 1's Gemma only; "
                              f"PaliGemma 2 is gemma2)")
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        act = "gelu_pytorch_tanh" if act == "gelu" else act  # GemmaConfig.__post_init__: the releases mean tanh
        if act not in ACTIVATIONS:
            raise ConfigError(f"paligemma text config: hidden_act={act!r}")
        head_dim = d.get("head_dim", 256)
        return cls(vocab_size=d.get("vocab_size", 256_000), hidden_size=d.get("hidden_size", 3072),
                   intermediate_size=d.get("intermediate_size", 24576),
                   num_hidden_layers=d.get("num_hidden_layers", 28),
                   num_attention_heads=d.get("num_attention_heads", 16),
                   num_key_value_heads=d.get("num_key_value_heads", 16), head_dim=head_dim,
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope=rope.read_rope({**d, "max_position_embeddings": d.get("max_position_embeddings", 8192)}, head_dim,
                                       what="paligemma text config"), hidden_act=act,
                   max_position_embeddings=d.get("max_position_embeddings", 8192),
                   attention_bias=bool(d.get("attention_bias", False)), pad_token_id=d.get("pad_token_id", 0))


@dataclass(frozen=True)
class PaliGemmaConfig(LanguageModelView):
    text: GemmaConfig
    vision: SiglipVisionConfig
    projection_dim: int
    image_token_id: int
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.projection_dim != self.text.hidden_size:
            raise ConfigError(f"paligemma config: projection_dim={self.projection_dim} must be the decoder's "
                              f"hidden_size {self.text.hidden_size} (the image rows replace token embeddings)")

    @classmethod
    def from_hf(cls, d: dict) -> "PaliGemmaConfig":
        """The release's config.json or transformers 5's save (rope_parameters, vision_config.projection_dim)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"paligemma config: no {key} (PaliGemma nests both towers' keys)")
        return cls(text=GemmaConfig.from_hf(d["text_config"]), vision=SiglipVisionConfig.from_hf(d["vision_config"]),
                   projection_dim=int(d.get("projection_dim", 2048)),
                   image_token_id=int(d.get("image_token_index", 256_000)),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))

    @classmethod
    def from_pretrained(cls, path) -> "PaliGemmaConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---- operators ------------------------------------------------------------------------------

def prefix_lm_mask(attention_mask, token_type_ids):
    """i32[B,T], i32[B,T] | None -> bool[B,T,T]: causal, OR both query and key of type 0; padding keys masked."""
    T = attention_mask.shape[1]
    idx = jnp.arange(T)
    allowed = (idx[None, :] <= idx[:, None])[None]
    if token_type_ids is not None:
        prefix = token_type_ids == 0
        allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])
    return allowed & attention_mask.astype(jnp.bool_)[:, None, :]


def rope_inv_freq(config: PaliGemmaConfig):  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.text.rope)


def layer_inputs(config: PaliGemmaConfig, attention_mask, position_ids=None, *, token_type_ids=None) -> LayerInputs:
    """The mask (prefix_lm_mask: with token_type_ids, the type-0 block) and RoPE cos/sin every layer shares;
    positions 1..T unless given (PaliGemma numbers from 1). i32[B,T], i32[B,T] | None, i32[B,T] | None."""
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(1, attention_mask.shape[1] + 1)[None], attention_mask.shape)
    return LayerInputs(prefix_lm_mask(attention_mask, token_type_ids), *rope.cos_sin(config.text.rope, position_ids))


# ---- modules --------------------------------------------------------------------------------

def GemmaMLP(config: GemmaConfig, lora_scaling: float = 2.0, name: str | None = None) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, lora_scaling=lora_scaling,
                    name=name)  # GeGLU (gelu_tanh)


class GemmaAttention(nn.Module):
    config: GemmaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c, (B, T, D) = self.config, x.shape
        linear = lambda f, name: LoraLinear(f, use_bias=c.attention_bias, scaling=self.lora_scaling, name=name)  # noqa: E731
        N, K, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = linear(N * hd, "q_proj")(x).reshape(B, T, N, hd)
        k = linear(K * hd, "k_proj")(x).reshape(B, T, K, hd)
        v = linear(K * hd, "v_proj")(x).reshape(B, T, K, hd)
        return linear(D, "o_proj")(attend(q, k, v, inputs, hd ** -0.5))


class GemmaDecoderLayer(nn.Module):
    config: GemmaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        attn_in = GemmaRMSNorm(c.rms_norm_eps, name="input_layernorm")(x)
        x = x + GemmaAttention(c, self.lora_scaling, name="self_attn")(attn_in, inputs)
        mlp = GemmaMLP(c, self.lora_scaling, name="mlp")
        return x + mlp(GemmaRMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(x))


class GemmaTextModel(nn.Module):
    config: GemmaConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        self.layers = [GemmaDecoderLayer(c, self.lora_scaling, name=f"layers_{i}") for i in range(c.num_hidden_layers)]
        self.norm = GemmaRMSNorm(c.rms_norm_eps)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D], times sqrt(hidden) as a float32 scalar
        c = self.config
        return _embed(self.embed_tokens.embedding, input_ids, c.pad_token_id) * jnp.float32(c.hidden_size ** 0.5)

    def __call__(self, embeds, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class PaliGemmaMultiModalProjector(nn.Module):
    config: PaliGemmaConfig

    @nn.compact
    def __call__(self, patches):  # f32[I,P,E] -> f32[I,P,D]
        return nn.Dense(self.config.projection_dim, name="linear")(patches)


class PaliGemmaModel(nn.Module):
    """transformers' PaliGemmaModel: `vision_tower`, `multi_modal_projector`, `language_model`, to hidden states."""
    config: PaliGemmaConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.vision_tower = SiglipVisionModel(c.vision)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(c)
        self.language_model = GemmaTextModel(c.text, self.lora_scaling)

    def encode_images(self, pixel_values):  # f32[I,C,S,S] -> f32[I*P, D]
        out = self.multi_modal_projector(self.vision_tower(pixel_values))
        return out.reshape(-1, out.shape[-1])

    def embed(self, input_ids):  # image ids past the vocabulary (the release's are not) embed as token 0
        c = self.config
        if c.image_token_id >= c.text.vocab_size:
            input_ids = jnp.where(input_ids == c.image_token_id, 0, input_ids)
        return self.language_model.embed(input_ids)

    def __call__(self, input_ids, attention_mask, token_type_ids=None, pixel_values=None, image_embeds=None):
        c = self.config
        exact = pixel_values is not None  # the tower's own rows: their count is checked; precomputed ones may be padded
        embeds = self.embed(input_ids)
        if exact:
            image_embeds = self.encode_images(pixel_values)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id, check_count=exact)
        return self.language_model(embeds, layer_inputs(c, attention_mask, token_type_ids=token_type_ids))


class PaliGemmaForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, pixel_values,
    token_type_ids); the tree: `model/vision_tower`, `model/multi_modal_projector`, `model/language_model`
    (`lm_head` only when untied)."""
    config: PaliGemmaConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        c = self.config
        self.model = PaliGemmaModel(c, self.lora_scaling)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]: the scaled token embeddings (text only)
        return self.model.embed(input_ids)

    def encode_images(self, pixel_values):
        """f32[I,C,S,S] -> f32[I*(S/patch)^2, D]: the rows that replace the image tokens, image by image (the
        frozen tower's output: a trainer computes it once per batch, outside its jitted step)."""
        return self.model.encode_images(pixel_values)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                 return_hidden: bool = False, image_embeds=None):
        """input_ids i32[B,T], attention_mask i32[B,T] (right padding), pixel_values f32[I,C,S,S] (or image_embeds
        f32[n,D], encode_images' output; rows past the image tokens' count are never read), token_type_ids
        i32[B,T] (0: the bidirectional prefix; None: causal) -> logits f32[B,T,V]."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, token_type_ids, pixel_values, image_embeds)
        if self.config.tie_word_embeddings:
            logits = hidden @ self.variables["params"]["model"]["language_model"]["embed_tokens"]["embedding"].T
        else:
            logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
