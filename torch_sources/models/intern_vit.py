"""The InternViT vision tower in pure PyTorch, eager fp32; jax_oracles/models/intern_vit.py is its twin.

transformers 5.24's InternVLVisionModel (models/internvl/modeling_internvl.py), the tower of every InternVL "-hf"
release (InternViT-300M-448px: LayerNorm, biased q/k/v; InternViT-6B: RMSNorm, qk-norm, unbiased q/k/v):
- embeddings: a Conv2d whose stride is its kernel (patch 14), a learned CLS token in front, learned absolute
  positions for CLS + the (448/14)^2 patches, bicubically resized (torch's align_corners=False, a = -0.75) when
  the image's patch grid differs from the table's or is not square;
- blocks, pre-norm with layer scale: x + lambda_1 * attn(norm_before(x)), then x + lambda_2 * mlp(norm_after(x));
  attention bidirectional over all tokens of one tile, q/k/v as separate projections, an optional RMSNorm (eps 1e-6)
  over the whole q and k vectors before the heads split; MLP fc1 -> act -> fc2;
- a final LayerNorm only when use_mean_pooling is false (every release pools, so the blocks' output is returned).
Submodule names equal transformers' (`embeddings.patch_embeddings.projection`, `encoder.layer.<i>.attention.q_proj`,
`...projection_layer`, `layernorm_before`, `lambda_1`, ...), so `tower.load_state_dict(hf_tower.state_dict())`
loads strictly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import ACTIVATIONS, LayerNorm, RMSNorm, eager_attention

__all__ = ["VISION_KEYS", "InternVLVisionConfig", "interpolate_pos_encoding",
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


def _norm(c: InternVLVisionConfig) -> nn.Module:
    return (LayerNorm if c.norm_type == "layer_norm" else RMSNorm)(c.hidden_size, c.layer_norm_eps)


# ---- operators ------------------------------------------------------------------------------

def interpolate_pos_encoding(table, grid_h: int, grid_w: int):
    """f32[1, 1+S*S, E] -> f32[1, 1+grid_h*grid_w, E]: the CLS row kept, the S x S patch rows resized bicubically
    (align_corners=False) to grid_h x grid_w. The table itself when it already has that square shape (transformers'
    shortcut: it interpolates whenever the patch counts differ or the image is not square)."""
    side = int(math.sqrt(table.shape[1] - 1))
    if side * side == grid_h * grid_w and grid_h == grid_w:
        return table
    cls_row, patches = table[:, :1], table[:, 1:]
    E = table.shape[-1]
    grid = patches.reshape(1, side, side, E).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
    return torch.cat([cls_row, grid.permute(0, 2, 3, 1).reshape(1, -1, E)], dim=1)


# ---- modules --------------------------------------------------------------------------------

class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        self.projection = nn.Conv2d(c.num_channels, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)

    def forward(self, pixel_values):  # f32[N,C,H,W] -> f32[N, (H/p)*(W/p), E], patches row-major
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        self.config = c
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.patch_embeddings = InternVLVisionPatchEmbeddings(c)
        self.position_embeddings = (nn.Parameter(torch.zeros(1, c.num_patches + 1, c.hidden_size))
                                    if c.use_absolute_position_embeddings else None)

    def forward(self, pixel_values):  # f32[N,C,H,W] -> f32[N, 1+(H/p)*(W/p), E]
        N, _, H, W = pixel_values.shape
        x = self.patch_embeddings(pixel_values)
        x = torch.cat([self.cls_token.expand(N, -1, -1), x], dim=1)
        if self.position_embeddings is not None:
            p = self.config.patch_size
            x = x + interpolate_pos_encoding(self.position_embeddings, H // p[0], W // p[1])
        return x


class InternVLVisionAttention(nn.Module):
    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        E, bias = c.hidden_size, c.attention_bias
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E, bias=bias) for _ in range(3))
        self.projection_layer = nn.Linear(E, E)  # always biased (transformers hard-codes it)
        if c.use_qk_norm:
            self.q_norm, self.k_norm = RMSNorm(E, QK_NORM_EPS), RMSNorm(E, QK_NORM_EPS)
        self.use_qk_norm = c.use_qk_norm

    def forward(self, x):  # f32[N,L,E] -> f32[N,L,E]
        N, L, E = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_qk_norm:  # over the whole E-vector, before the heads split
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(N, L, self.num_heads, self.head_dim) for t in (q, k, v))
        every = torch.ones(N, L, L, dtype=torch.bool, device=x.device)  # no mask: all tokens of a tile see each other
        out = eager_attention(q, k, v, every, self.head_dim ** -0.5)
        return self.projection_layer(out.reshape(N, L, E))


class InternVLVisionMLP(nn.Module):
    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class InternVLVisionLayer(nn.Module):
    """x + lambda_1 * attn(layernorm_before(x)), then x + lambda_2 * mlp(layernorm_after(x))."""

    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        self.attention = InternVLVisionAttention(c)
        self.mlp = InternVLVisionMLP(c)
        self.layernorm_before, self.layernorm_after = _norm(c), _norm(c)
        self.lambda_1 = nn.Parameter(torch.ones(c.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(c.hidden_size))

    def forward(self, x):  # f32[N,L,E] -> f32[N,L,E]
        x = self.lambda_1 * self.attention(self.layernorm_before(x)) + x
        return self.lambda_2 * self.mlp(self.layernorm_after(x)) + x


class InternVLVisionEncoder(nn.Module):
    def __init__(self, c: InternVLVisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(InternVLVisionLayer(c) for _ in range(c.num_hidden_layers))


class InternVLVisionModel(nn.Module):
    def __init__(self, config: InternVLVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = InternVLVisionEmbeddings(config)
        self.encoder = InternVLVisionEncoder(config)
        if not config.use_mean_pooling:
            self.layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixel_values, feature_layer: int = -1):
        """pixel_values f32[N,C,H,W] (one tile per row) -> f32[N, 1+(H/p)*(W/p), E], CLS first: the last block's
        output (through `layernorm` when use_mean_pooling is false) for feature_layer -1, else transformers'
        hidden_states[feature_layer] (index 0: the embeddings; i: block i's output, no final norm)."""
        x = self.embeddings(pixel_values)
        states = [x]
        for layer in self.encoder.layer:
            x = layer(x)
            states.append(x)
        if feature_layer == -1:
            return x if self.config.use_mean_pooling else self.layernorm(x)
        return states[feature_layer]
