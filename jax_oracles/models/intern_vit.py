"""The InternViT vision tower in Flax Linen: the torch-free twin of torch_sources/models/intern_vit.py.

Same public names in the same order, same numerics (see the torch file's docstring). Params are named after the
checkpoint (`embeddings/cls_token`, `embeddings/position_embeddings`, `embeddings/patch_embeddings/projection/
weight` in the Conv2d's stored layout f32[E,C,p,p], `encoder/layer_<i>/attention/q_proj/kernel`, ...; see
conversion/internvl.py). The position table's bicubic resize (torch's F.interpolate, align_corners=False,
a = -0.75, border taps clamped) is two host-built f32 matrices, one per axis, since the grid is static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import ACTIVATIONS, LayerNorm, RMSNorm, eager_attention

__all__ = ["VISION_KEYS", "InternVLVisionConfig", "bicubic_matrix", "interpolate_pos_encoding",
           "InternVLVisionPatchEmbeddings", "InternVLVisionEmbeddings", "InternVLVisionAttention", "InternVLVisionMLP",
           "InternVLVisionLayer", "InternVLVisionEncoder", "InternVLVisionModel"]

QK_NORM_EPS = 1e-6  # InternVLVisionRMSNorm's default: transformers passes no eps to the q/k norms

# InternVLVisionConfig's keys, plus what the releases' vision_config adds (the original InternViT config's).
VISION_KEYS = KeyAudit(
    "internvl vision",
    honored=frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "attention_bias", "use_qk_norm",
                       "intermediate_size", "hidden_act", "norm_type", "layer_norm_eps", "image_size", "patch_size",
                       "num_channels", "use_absolute_position_embeddings", "use_mean_pooling"}),
    ignored={"hidden_dropout_prob": DROPOUT, "attention_dropout": DROPOUT, "projection_dropout": DROPOUT,
             "dropout": DROPOUT,
             "layer_scale_init_value": "the lambdas' init only; every weight comes from the checkpoint",
             "initializer_factor": "random init only (the original InternViT config's key)"},
    refused={"use_mask_token": ((False,), "a mask token for masked-image pretraining: the VLM never masks patches "
                                          "and no release stores one")})


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


@dataclass(frozen=True)
class InternVLVisionConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    attention_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-6
    image_size: tuple[int, int] = (448, 448)
    patch_size: tuple[int, int] = (14, 14)
    num_channels: int = 3
    use_absolute_position_embeddings: bool = True
    use_mean_pooling: bool = True

    def __post_init__(self):
        assert self.hidden_size % self.num_attention_heads == 0, "heads must split hidden_size"

    @classmethod
    def from_hf(cls, d: dict) -> "InternVLVisionConfig":
        """vision_config as the release writes it (or transformers 5 saves it); defaults are InternVLVisionConfig's."""
        VISION_KEYS.check(d)
        if d.get("norm_type", "layer_norm") not in ("layer_norm", "rms_norm"):
            raise ConfigError(f"internvl vision config: norm_type={d['norm_type']!r} (layer_norm or rms_norm)")
        if d.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise ConfigError(f"internvl vision config: hidden_act={d['hidden_act']!r} (known: {sorted(ACTIVATIONS)})")
        kw = {k: d[k] for k in VISION_KEYS.honored if k in d}
        for key in ("image_size", "patch_size"):
            if key in kw:
                kw[key] = _pair(kw[key])
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:  # the position table's patch rows (CLS excluded)
        return (self.image_size[0] // self.patch_size[0]) * (self.image_size[1] // self.patch_size[1])


def _norm(c: InternVLVisionConfig, name: str) -> nn.Module:
    return LayerNorm(c.layer_norm_eps, name=name) if c.norm_type == "layer_norm" else RMSNorm(c.layer_norm_eps, name=name)


# ---- operators ------------------------------------------------------------------------------

def _cubic(x, a=np.float32(-0.75)):  # torch's cubic_convolution1 (|x| <= 1) and cubic_convolution2 (1 < |x| < 2)
    return (((a + 2) * x - (a + 3)) * x * x + 1), (((a * x - 5 * a) * x + 8 * a) * x - 4 * a)


def bicubic_matrix(in_size: int, out_size: int) -> np.ndarray:
    """f32[out, in]: torch's upsample_bicubic2d along one axis (align_corners=False, source = scale*(i+0.5)-0.5
    unclamped, four taps clamped to the border), in float32 as torch's CPU kernel computes it."""
    scale = np.float32(in_size / out_size)
    real = scale * (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    index = np.floor(real).astype(np.int64)
    t = (real - index).astype(np.float32)
    one = np.float32(1)
    weights = [_cubic(t + one)[1], _cubic(t)[0], _cubic(one - t)[0], _cubic(np.float32(2) - t)[1]]
    m = np.zeros((out_size, in_size), np.float32)
    for k, w in enumerate(weights):
        np.add.at(m, (np.arange(out_size), np.clip(index - 1 + k, 0, in_size - 1)), w)
    return m


def interpolate_pos_encoding(table, grid_h: int, grid_w: int):
    """f32[1, 1+S*S, E] -> f32[1, 1+grid_h*grid_w, E]: the CLS row kept, the S x S patch rows resized bicubically
    (align_corners=False) to grid_h x grid_w. The table itself when it already has that square shape (transformers'
    shortcut: it interpolates whenever the patch counts differ or the image is not square)."""
    side = int(math.sqrt(table.shape[1] - 1))
    if side * side == grid_h * grid_w and grid_h == grid_w:
        return table
    E = table.shape[-1]
    grid = table[0, 1:].reshape(side, side, E)
    grid = jnp.einsum("hs,stE,wt->hwE", bicubic_matrix(side, grid_h), grid, bicubic_matrix(side, grid_w),
                      precision="highest")
    return jnp.concatenate([table[:, :1], grid.reshape(1, grid_h * grid_w, E)], axis=1)


# ---- modules --------------------------------------------------------------------------------

class _Conv2dProjection(nn.Module):
    """The Conv2d (kernel = stride = patch) as one matmul per patch; `weight` keeps the checkpoint's f32[E,C,p,p]
    (so the conversion table is a pure rename, invertible by hf_layout)."""
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[N,C,H,W] -> f32[N, (H/p)*(W/p), E], patches row-major
        c = self.config
        E, (ph, pw) = c.hidden_size, c.patch_size
        N, C, H, W = pixel_values.shape
        weight = self.param("weight", nn.initializers.lecun_normal(), (E, C, ph, pw), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (E,), jnp.float32)
        patches = pixel_values.reshape(N, C, H // ph, ph, W // pw, pw).transpose(0, 2, 4, 1, 3, 5)
        return patches.reshape(N, (H // ph) * (W // pw), C * ph * pw) @ weight.reshape(E, -1).T + bias


class InternVLVisionPatchEmbeddings(nn.Module):
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[N,C,H,W] -> f32[N, (H/p)*(W/p), E]
        return _Conv2dProjection(self.config, name="projection")(pixel_values)


class InternVLVisionEmbeddings(nn.Module):
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, pixel_values):  # f32[N,C,H,W] -> f32[N, 1+(H/p)*(W/p), E]
        c = self.config
        N, _, H, W = pixel_values.shape
        cls_token = self.param("cls_token", nn.initializers.zeros_init(), (1, 1, c.hidden_size), jnp.float32)
        x = InternVLVisionPatchEmbeddings(c, name="patch_embeddings")(pixel_values)
        x = jnp.concatenate([jnp.broadcast_to(cls_token, (N, 1, c.hidden_size)), x], axis=1)
        if c.use_absolute_position_embeddings:
            table = self.param("position_embeddings", nn.initializers.zeros_init(),
                               (1, c.num_patches + 1, c.hidden_size), jnp.float32)
            x = x + interpolate_pos_encoding(table, H // c.patch_size[0], W // c.patch_size[1])
        return x


class InternVLVisionAttention(nn.Module):
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[N,L,E] -> f32[N,L,E]
        c = self.config
        N, L, E = x.shape
        q, k, v = (nn.Dense(E, use_bias=c.attention_bias, name=n)(x) for n in ("q_proj", "k_proj", "v_proj"))
        if c.use_qk_norm:  # over the whole E-vector, before the heads split
            q, k = RMSNorm(QK_NORM_EPS, name="q_norm")(q), RMSNorm(QK_NORM_EPS, name="k_norm")(k)
        q, k, v = (t.reshape(N, L, c.num_attention_heads, c.head_dim) for t in (q, k, v))
        every = jnp.ones((N, L, L), jnp.bool_)  # no mask: all tokens of a tile see each other
        out = eager_attention(q, k, v, every, c.head_dim ** -0.5)
        return nn.Dense(E, name="projection_layer")(out.reshape(N, L, E))


class InternVLVisionMLP(nn.Module):
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = ACTIVATIONS[c.hidden_act](nn.Dense(c.intermediate_size, name="fc1")(x))
        return nn.Dense(c.hidden_size, name="fc2")(h)


class InternVLVisionLayer(nn.Module):
    """x + lambda_1 * attn(layernorm_before(x)), then x + lambda_2 * mlp(layernorm_after(x))."""
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, x):  # f32[N,L,E] -> f32[N,L,E]
        c = self.config
        lambda_1 = self.param("lambda_1", nn.initializers.ones_init(), (c.hidden_size,), jnp.float32)
        lambda_2 = self.param("lambda_2", nn.initializers.ones_init(), (c.hidden_size,), jnp.float32)
        x = lambda_1 * InternVLVisionAttention(c, name="attention")(_norm(c, "layernorm_before")(x)) + x
        return lambda_2 * InternVLVisionMLP(c, name="mlp")(_norm(c, "layernorm_after")(x)) + x


class InternVLVisionEncoder(nn.Module):
    config: InternVLVisionConfig

    def setup(self):
        self.layer = [InternVLVisionLayer(self.config, name=f"layer_{i}") for i in range(self.config.num_hidden_layers)]

    def __call__(self, x):  # -> [f32[N,L,E]] * (1 + layers): the input, then every block's output
        states = [x]
        for layer in self.layer:
            x = layer(x)
            states.append(x)
        return states


class InternVLVisionModel(nn.Module):
    config: InternVLVisionConfig

    @nn.compact
    def __call__(self, pixel_values, feature_layer: int = -1):
        """pixel_values f32[N,C,H,W] (one tile per row) -> f32[N, 1+(H/p)*(W/p), E], CLS first: the last block's
        output (through `layernorm` when use_mean_pooling is false) for feature_layer -1, else transformers'
        hidden_states[feature_layer] (index 0: the embeddings; i: block i's output, no final norm)."""
        c = self.config
        states = InternVLVisionEncoder(c, name="encoder")(InternVLVisionEmbeddings(c, name="embeddings")(pixel_values))
        last = states[-1]
        if not c.use_mean_pooling:  # declared whatever the feature layer, as torch's module
            last = LayerNorm(c.layer_norm_eps, name="layernorm")(last)
        return last if feature_layer == -1 else states[feature_layer]
