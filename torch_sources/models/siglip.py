"""The SigLIP vision tower (no head) in pure PyTorch, eager fp32: the tower of Gemma 3 and PaliGemma.
jax_oracles/models/siglip.py is its twin.

transformers 5.24's SiglipVisionModel with `vision_use_head: false` (siglip/modeling_siglip.py): a Conv2d patch
embedding whose stride is its kernel (one matmul per patch, biased), a learned position table (one row per patch,
no CLS), pre-LayerNorm encoder layers (biased q/k/v/out_proj, full bidirectional attention over the image's
patches, fc1 -> gelu_tanh -> fc2), and `post_layernorm` on the last hidden state. The pixels must have the
configured image_size: the families here never interpolate the position table.

The releases of both families store the tower under `vision_tower.vision_model.*`; transformers 5 holds it as
`model.vision_tower.*` (its CLIPVisionModel rename drops `vision_model`, and save_pretrained writes
`vision_tower.*`). `release_to_module_name` maps every stored name of a LLaVA-layout checkpoint (`language_model.
model.*`, `language_model.lm_head.*`, `vision_tower.[vision_model.]*`, `multi_modal_projector.*`) onto the module
tree, and `load_llava_layout` loads such a checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import ACTIVATIONS, LayerNorm, eager_attention
from torch_sources.models.loading import iter_tensors

__all__ = [
    "VISION_KEYS", "SiglipVisionConfig",
    "SiglipVisionEmbeddings", "SiglipAttention", "SiglipMLP", "SiglipEncoderLayer", "SiglipEncoder",
    "SiglipVisionModel",
]  # release_to_module_name and load_llava_layout are the torch loader's (conversion/ maps the JAX names): not mirrored

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
        """vision_config's keys over `defaults` (a VLM's config class may set its own, as PaliGemma does) over
        SiglipVisionConfig's."""
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

class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.patch_size = c.patch_size
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)

    def forward(self, pixel_values):  # f32[I,C,H,W] -> f32[I,P,E], patches row-major
        I, C, H, W = pixel_values.shape
        p = self.patch_size
        if H * W // (p * p) != self.position_embedding.num_embeddings or H != W:
            raise ValueError(f"pixel_values of {H}x{W}: the tower takes the configured square image size")
        patches = pixel_values.reshape(I, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(I, -1, C * p * p)
        weight = self.patch_embedding.weight.reshape(self.patch_embedding.out_channels, -1)  # [E, C*p*p]
        return F.linear(patches, weight, self.patch_embedding.bias) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            setattr(self, name, nn.Linear(c.hidden_size, c.hidden_size))

    def forward(self, x):  # f32[I,P,E] -> f32[I,P,E]: every patch sees every patch of its image
        I, P, _ = x.shape
        q, k, v = (proj(x).view(I, P, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = torch.ones(I, P, P, dtype=torch.bool, device=x.device)
        return self.out_proj(eager_attention(q, k, v, mask, self.head_dim ** -0.5).reshape(I, P, -1))


class SiglipMLP(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.self_attn = SiglipAttention(c)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.mlp = SiglipMLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionModel(nn.Module):
    """transformers' SiglipVisionModel without its head: the post-normed last hidden state."""

    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixel_values):  # f32[I,C,S,S] -> f32[I,(S/p)^2,E]
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


# ---- the LLaVA checkpoint layout both families' releases use ----------------------------------

_RENAMES = (  # (stored name regex, module name): the release's form, and transformers 5's save (no vision_model)
    (r"language_model\.lm_head\.(.+)", r"lm_head.\1"),
    (r"language_model\.model\.(.+)", r"model.language_model.\1"),
    (r"vision_tower\.(?:vision_model\.)?(.+)", r"model.vision_tower.\1"),
    (r"multi_modal_projector\.(.+)", r"model.multi_modal_projector.\1"),
)


def release_to_module_name(name: str) -> str:
    """A LLaVA-layout checkpoint's tensor name -> the module tree's (transformers 5's in-memory name)."""
    for pattern, target in _RENAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name)
    if name.startswith(("model.", "lm_head.")):  # already the in-memory name (save_original_format=False)
        return name
    raise ValueError(f"checkpoint tensor {name!r} belongs to no part of a LLaVA-layout model")


def load_llava_layout(build, config, path) -> nn.Module:
    """`build(config)` on the meta device, every parameter from the checkpoint (fp32, renamed to the module
    tree), eval mode. A tied model takes its head from the embedding (a stored copy is dropped)."""
    with torch.device("meta"):
        model = build(config)
    state = {release_to_module_name(n): t.to(torch.float32) for n, t in iter_tensors(path)}
    embed = "model.language_model.embed_tokens.weight"
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state[embed]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.get_parameter(embed)
    return model.eval()
