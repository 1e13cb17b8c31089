"""The CLIP vision tower in Flax Linen: the torch-free twin of torch_sources/models/clip.py (see its docstring).

Same public names in the same order. Params are named after transformers' in-memory CLIPVisionModel
(`embeddings/patch_embedding/weight` keeps the Conv2d layout f32[E,C,ps,ps], `embeddings/position_embedding/
embedding`, `encoder/layers_<i>/self_attn/q_proj/kernel`, ...). The projections are plain Dense layers: LLaMA-Factory
freezes the tower, so no LoRA adapter reaches it. Every block runs and the pooled CLS is computed, as transformers
does (the params exist for the conversion check both ways); under jit what nothing reads is pruned.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import LayerNorm, eager_attention
from jax_oracles.models.vision import VISION_ACTIVATIONS

__all__ = ["CLIP_VISION_KEYS", "CLIPVisionConfig", "CLIPVisionEmbeddings", "CLIPAttention", "CLIPMLP",
           "CLIPEncoderLayer", "CLIPEncoder", "CLIPVisionModel"]

# CLIPVisionConfig's keys, plus the release's legacy `vocab_size` in LLaVA's vision_config.
CLIP_VISION_KEYS = KeyAudit(
    "clip_vision_model",
    honored=frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                       "image_size", "patch_size", "hidden_act", "layer_norm_eps"}),
    ignored={"attention_dropout": DROPOUT,
             "projection_dim": "CLIPModel's visual_projection, which the vision model alone does not have",
             "initializer_factor": "random init only; every weight comes from the checkpoint",
             "vocab_size": "a text-tower key the LLaVA releases copy into vision_config; no vision layer reads it"})


@dataclass(frozen=True)
class CLIPVisionConfig:
    """Fields and defaults are CLIPVisionConfig's (a release's vision_config may state only some keys)."""
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_hf(cls, d: dict) -> "CLIPVisionConfig":
        CLIP_VISION_KEYS.check(d)
        if d.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ConfigError(f"vision_config model_type {d['model_type']!r}: only the CLIP tower is mirrored here")
        if d.get("hidden_act", cls.hidden_act) not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act {d['hidden_act']!r} is not one of {sorted(VISION_ACTIVATIONS)}")
        c = cls(**{k: d[k] for k in CLIP_VISION_KEYS.honored if k in d})
        if c.hidden_size % c.num_attention_heads or c.image_size % c.patch_size:
            raise ConfigError(f"vision_config: hidden_size {c.hidden_size} / {c.num_attention_heads} heads or "
                              f"image_size {c.image_size} / patch_size {c.patch_size} does not divide")
        return c

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _PatchConv(nn.Module):
    """torch's Conv2d(C, E, ps, stride=ps, bias=False) on whole patches: one matmul per patch with the flattened
    (C, ps, ps) kernel; `weight` keeps the Conv2d layout f32[E,C,ps,ps] (a pure rename in the conversion)."""
    features: int
    channels: int
    patch_size: int

    @nn.compact
    def __call__(self, pixel_values):  # f32[N,C,H,W] -> f32[N, (H/ps)*(W/ps), E], patches row-major
        E, C, ps = self.features, self.channels, self.patch_size
        weight = self.param("weight", nn.initializers.lecun_normal(), (E, C, ps, ps), jnp.float32)
        N, _, H, W = pixel_values.shape
        patches = pixel_values.reshape(N, C, H // ps, ps, W // ps, ps).transpose(0, 2, 4, 1, 3, 5)
        return patches.reshape(N, (H // ps) * (W // ps), C * ps * ps) @ weight.reshape(E, -1).T


class CLIPVisionEmbeddings(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[N,C,H,W] -> f32[N, 1+P, E]: [CLS, patches row-major] + positions
        c = self.config
        E, side = c.hidden_size, c.num_patches_per_side
        N, _, H, W = pixel_values.shape
        if (H, W) != (c.image_size, c.image_size):  # transformers refuses too (no position interpolation here)
            raise ValueError(f"Input image size ({H}*{W}) doesn't match model ({c.image_size}*{c.image_size}).")
        class_embedding = self.param("class_embedding", nn.initializers.normal(1.0), (E,), jnp.float32)
        patches = _PatchConv(E, c.num_channels, c.patch_size, name="patch_embedding")(pixel_values)
        positions = nn.Embed(side * side + 1, E, name="position_embedding").embedding
        cls = jnp.broadcast_to(class_embedding, (N, 1, E))
        return jnp.concatenate([cls, patches], axis=1) + positions


class CLIPAttention(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[N,T,E] -> f32[N,T,E]: every token attends every token of its tile
        c = self.config
        N, T, E = x.shape
        k, v, q = (nn.Dense(E, name=n)(x).reshape(N, T, c.num_attention_heads, c.head_dim)
                   for n in ("k_proj", "v_proj", "q_proj"))
        everyone = jnp.ones((N, T, T), jnp.bool_)
        return nn.Dense(E, name="out_proj")(eager_attention(q, k, v, everyone, c.head_dim ** -0.5).reshape(N, T, E))


class CLIPMLP(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        hidden = VISION_ACTIVATIONS[c.hidden_act](nn.Dense(c.intermediate_size, name="fc1")(x))
        return nn.Dense(c.hidden_size, name="fc2")(hidden)


class CLIPEncoderLayer(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[N,T,E] -> f32[N,T,E]
        c = self.config
        x = x + CLIPAttention(c, name="self_attn")(LayerNorm(c.layer_norm_eps, name="layer_norm1")(x))
        return x + CLIPMLP(c, name="mlp")(LayerNorm(c.layer_norm_eps, name="layer_norm2")(x))


class CLIPEncoder(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[N,T,E] -> [f32[N,T,E]] * (L+1): the input, then every block's output
        hidden_states = [x]
        for i in range(self.config.num_hidden_layers):
            hidden_states.append(CLIPEncoderLayer(self.config, name=f"layers_{i}")(hidden_states[-1]))
        return hidden_states


class CLIPVisionModel(nn.Module):
    config: CLIPVisionConfig

    @nn.compact
    def __call__(self, pixel_values):
        """pixel_values f32[N,C,S,S] -> (hidden_states [f32[N,1+P,E]] * (L+1), pooler_output f32[N,E]): as
        transformers' CLIPVisionModel with output_hidden_states (the pooled CLS is post_layernorm'd)."""
        c = self.config
        embeds = CLIPVisionEmbeddings(c, name="embeddings")(pixel_values.astype(jnp.float32))
        hidden_states = CLIPEncoder(c, name="encoder")(LayerNorm(c.layer_norm_eps, name="pre_layrnorm")(embeds))
        return hidden_states, LayerNorm(c.layer_norm_eps, name="post_layernorm")(hidden_states[-1][:, 0])
