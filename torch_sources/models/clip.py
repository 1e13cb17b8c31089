"""The CLIP vision tower in pure PyTorch, eager fp32 (LLaVA's and LLaVA-NeXT's); jax_oracles/models/clip.py is its twin.

transformers 5.24's CLIPVisionModel (models/clip/modeling_clip.py): a Conv2d patch embedding without bias (stride =
kernel = patch_size), a learned class embedding in front, learned absolute positions (one per patch plus the CLS),
`pre_layrnorm`, then pre-LN blocks (x + attn(layer_norm1(x)), x + mlp(layer_norm2(x))) with separate biased
q/k/v/out projections, full bidirectional attention over the tile's tokens, and an fc1-act-fc2 MLP (quick_gelu in
every CLIP release). `post_layernorm` normalises the pooled CLS only, which LLaVA never reads; it stays in the tree
so the checkpoint loads strictly. The tower returns every hidden state as transformers does (hidden_states[0]: the
input of the first block, after pre_layrnorm; hidden_states[i]: block i-1's output, no final norm), so a caller reads
one by index (LLaVA's vision_feature_layer -2: the input of the last block).

Submodule names equal transformers' in-memory CLIPVisionModel (`embeddings`, `pre_layrnorm`, `encoder.layers.<i>`,
`post_layernorm`); releases store it under an extra `vision_model.` prefix, which the loaders strip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import LayerNorm, eager_attention
from torch_sources.models.vision import VISION_ACTIVATIONS

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


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        self.image_size = c.image_size
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size))
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False)
        self.position_embedding = nn.Embedding(c.num_patches_per_side ** 2 + 1, c.hidden_size)

    def forward(self, pixel_values):  # f32[N,C,H,W] -> f32[N, 1+P, E]: [CLS, patches row-major] + positions
        N, _, H, W = pixel_values.shape
        if (H, W) != (self.image_size, self.image_size):  # transformers refuses too (no position interpolation here)
            raise ValueError(f"Input image size ({H}*{W}) doesn't match model ({self.image_size}*{self.image_size}).")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(N, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        E = c.hidden_size
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x):  # f32[N,T,E] -> f32[N,T,E]: every token attends every token of its tile
        N, T, E = x.shape
        q, k, v = (proj(x).view(N, T, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        everyone = torch.ones(N, T, T, dtype=torch.bool, device=x.device)
        return self.out_proj(eager_attention(q, k, v, everyone, self.head_dim ** -0.5).reshape(N, T, E))


class CLIPMLP(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        self.act = VISION_ACTIVATIONS[c.hidden_act]
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        self.self_attn = CLIPAttention(c)
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.mlp = CLIPMLP(c)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps)

    def forward(self, x):  # f32[N,T,E] -> f32[N,T,E]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x):  # f32[N,T,E] -> [f32[N,T,E]] * (L+1): the input, then every block's output
        hidden_states = [x]
        for layer in self.layers:
            hidden_states.append(layer(hidden_states[-1]))
        return hidden_states


class CLIPVisionModel(nn.Module):
    def __init__(self, c: CLIPVisionConfig):
        super().__init__()
        self.config = c
        self.embeddings = CLIPVisionEmbeddings(c)
        self.pre_layrnorm = LayerNorm(c.hidden_size, c.layer_norm_eps)  # sic: transformers' name
        self.encoder = CLIPEncoder(c)
        self.post_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps)

    def forward(self, pixel_values):
        """pixel_values f32[N,C,S,S] -> (hidden_states [f32[N,1+P,E]] * (L+1), pooler_output f32[N,E]): as
        transformers' CLIPVisionModel with output_hidden_states (the pooled CLS is post_layernorm'd)."""
        hidden_states = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values.to(torch.float32))))
        return hidden_states, self.post_layernorm(hidden_states[-1][:, 0])
