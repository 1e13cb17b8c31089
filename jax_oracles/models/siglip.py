"""The SigLIP vision tower (no head) in Flax Linen: the torch-free twin of torch_sources/models/siglip.py.

Same public names in the same order, same numerics: the patch embedding as one matmul per patch with the stored
Conv2d weight [E, C, p, p] (kept as stored), the learned position table, pre-LayerNorm encoder layers with full
attention over one image's patches, post_layernorm. Params are named like the torch module tree
(`embeddings/patch_embedding/{weight,bias}`, `encoder/layers_<i>/self_attn/q_proj/kernel`, ...; see
conversion/gemma3.py and conversion/paligemma.py for the release names). The tower's projections are plain Dense
layers: LLaMA-Factory freezes the vision tower (freeze_vision_tower), so no adapter reaches them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import ACTIVATIONS, LayerNorm, eager_attention

__all__ = [
    "VISION_KEYS", "SiglipVisionConfig",
    "SiglipVisionEmbeddings", "SiglipAttention", "SiglipMLP", "SiglipEncoderLayer", "SiglipEncoder",
    "SiglipVisionModel",
]

VISION_KEYS = KeyAudit(
    "siglip vision",
    honored=frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps"}),
    ignored={"attention_dropout": DROPOUT,
             "projection_dim": "PaliGemma copies its projector width here; the tower does not read it",
             "projector_hidden_act": "PaliGemma's release writes it; no transformers 5.24 module reads it",
             "num_image_tokens": "PaliGemma's release writes it; derived from image_size / patch_size",
             "vocab_size": "PaliGemma's old default carries it; the tower has no vocabulary"},
    refused={"vision_use_head": ((False,), "the attention-pooling head: unused by both VLMs, absent from the "
                                           "releases")})


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"siglip vision config: hidden_act={self.hidden_act!r} (known: {sorted(ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("siglip vision config: hidden_size is not a multiple of num_attention_heads")

    @classmethod
    def from_hf(cls, d: dict, **defaults) -> "SiglipVisionConfig":
        """vision_config's keys over `defaults` over SiglipVisionConfig's."""
        VISION_KEYS.check(d)
        for key in ("image_size", "patch_size"):
            if isinstance(d.get(key), (list, tuple)):
                raise ConfigError(f"siglip vision config: {key}={d[key]!r} (a square int only)")
        merged = {**defaults, **d}
        return cls(**{f.name: merged[f.name] for f in fields(cls) if f.name in merged})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


# ---- modules --------------------------------------------------------------------------------

class _PatchEmbedding(nn.Module):  # the Conv2d's weight f32[E,C,p,p] and bias f32[E], as stored
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, patches):  # f32[I,P,C*p*p] -> f32[I,P,E]
        c = self.config
        shape = (c.hidden_size, c.num_channels, c.patch_size, c.patch_size)
        weight = self.param("weight", nn.initializers.lecun_normal(), shape, jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (c.hidden_size,), jnp.float32)
        return patches @ weight.reshape(c.hidden_size, -1).T + bias


class SiglipVisionEmbeddings(nn.Module):
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[I,C,H,W] -> f32[I,P,E], patches row-major
        c = self.config
        I, C, H, W = pixel_values.shape
        p = c.patch_size
        if H != c.image_size or W != c.image_size:
            raise ValueError(f"pixel_values of {H}x{W}: the tower takes the configured square image size")
        patches = pixel_values.reshape(I, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(I, -1, C * p * p)
        table = nn.Embed(c.num_patches, c.hidden_size, name="position_embedding").embedding
        return _PatchEmbedding(c, name="patch_embedding")(patches) + table


class SiglipAttention(nn.Module):
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[I,P,E] -> f32[I,P,E]: every patch sees every patch of its image
        c = self.config
        I, P, E = x.shape
        q, k, v = (nn.Dense(E, name=n)(x).reshape(I, P, c.num_attention_heads, c.head_dim)
                   for n in ("q_proj", "k_proj", "v_proj"))
        out = eager_attention(q, k, v, jnp.ones((I, P, P), jnp.bool_), c.head_dim ** -0.5)
        return nn.Dense(E, name="out_proj")(out.reshape(I, P, E))


class SiglipMLP(nn.Module):
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        hidden = ACTIVATIONS[c.hidden_act](nn.Dense(c.intermediate_size, name="fc1")(x))
        return nn.Dense(c.hidden_size, name="fc2")(hidden)


class SiglipEncoderLayer(nn.Module):
    """Pre-norm: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        x = x + SiglipAttention(c, name="self_attn")(LayerNorm(c.layer_norm_eps, name="layer_norm1")(x))
        return x + SiglipMLP(c, name="mlp")(LayerNorm(c.layer_norm_eps, name="layer_norm2")(x))


class SiglipEncoder(nn.Module):
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, x):
        for i in range(self.config.num_hidden_layers):
            x = SiglipEncoderLayer(self.config, name=f"layers_{i}")(x)
        return x


class SiglipVisionModel(nn.Module):
    """transformers' SiglipVisionModel without its head: the post-normed last hidden state."""
    config: SiglipVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[I,C,S,S] -> f32[I,(S/p)^2,E]
        c = self.config
        x = SiglipEncoder(c, name="encoder")(SiglipVisionEmbeddings(c, name="embeddings")(pixel_values))
        return LayerNorm(c.layer_norm_eps, name="post_layernorm")(x)
