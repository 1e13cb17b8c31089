"""PaliGemma (1) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers 5.24's PaliGemmaForConditionalGeneration (paligemma/modeling_paligemma.py) over a Gemma 1 decoder
(gemma/modeling_gemma.py):
- Gemma 1: pre-norm blocks whose RMSNorm computes x_hat * (1 + w) in fp32 (models/gemma3.py's norm), attention
  with num_key_value_heads as configured (the release: multi-query, one KV head) scaled by head_dim^-1/2, default
  RoPE, GeGLU (hidden_act: the legacy "gelu" is read as gelu_tanh, as GemmaConfig does), the embedding scaled by
  sqrt(hidden) (a float32 scalar cast to the weight's dtype), the head tied to the embedding;
- the SigLIP tower (models/siglip.py) and one biased Linear (`multi_modal_projector.linear`) to the LM width; the
  rows replace the `<image>` tokens, which the prompt places before bos (`<image>*n <bos> prompt \n`);
- positions 1..T (PaliGemma's are 1-indexed), and the prefix-LM mask transformers 5 builds from token_type_ids:
  every token with type 0 joins one bidirectional block (a key of type 0 is visible to a query of type 0 wherever
  it sits), everything else is causal, padding keys are masked. LLaMA-Factory gives 0 to the image tokens and 1 to
  the text, so only the image block is bidirectional. transformers 5.24 reads labels only for the loss: the
  training forward (train mode, dropout 0, labels passed) is this one; transformers 4.x used labels to choose the
  mask in training, 5.x does not. Without token_type_ids the mask is causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import rope
from torch_sources.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from torch_sources.models.gemma3 import Gemma3RMSNorm as GemmaRMSNorm, gemma_rms_norm, rms_norm
from torch_sources.models.layers import (ACTIVATIONS, GatedMLP, LayerInputs, apply_rope, attend, causal_mask,
                                         eager_attention, rope_cos_sin)
from torch_sources.models.loading import load_config
from torch_sources.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from torch_sources.models.siglip import SiglipVisionConfig, SiglipVisionModel, load_llava_layout

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
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def prefix_lm_mask(attention_mask, token_type_ids) -> torch.Tensor:
    """i64[B,T], i64[B,T] | None -> bool[B,T,T]: causal, OR both query and key of type 0; padding keys masked."""
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    allowed = (idx[None, :] <= idx[:, None])[None]
    if token_type_ids is not None:
        prefix = token_type_ids == 0
        allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])
    return allowed & attention_mask.bool()[:, None, :]


def rope_inv_freq(config: PaliGemmaConfig) -> torch.Tensor:  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.text.rope)


def layer_inputs(config: PaliGemmaConfig, attention_mask, position_ids=None, *, token_type_ids=None) -> LayerInputs:
    """The mask (prefix_lm_mask: with token_type_ids, the type-0 block) and RoPE cos/sin every layer shares;
    positions 1..T unless given (PaliGemma numbers from 1). i64[B,T], i64[B,T] | None, i64[B,T] | None."""
    if position_ids is None:
        position_ids = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)[None]
        position_ids = position_ids.expand_as(attention_mask)
    return LayerInputs(prefix_lm_mask(attention_mask, token_type_ids), *rope.cos_sin(config.text.rope, position_ids))


# ---- modules --------------------------------------------------------------------------------

def GemmaMLP(config: GemmaConfig) -> GatedMLP:  # GeGLU (gelu_tanh)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class GemmaAttention(nn.Module):
    def __init__(self, c: GemmaConfig):
        super().__init__()
        self.c = c
        D, hd, bias = c.hidden_size, c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(D, c.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, c.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, c.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, D, bias=bias)

    def forward(self, x, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c, (B, T, _) = self.c, x.shape
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        return self.o_proj(attend(q, k, v, inputs, c.head_dim ** -0.5))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, c: GemmaConfig):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = GemmaAttention(c)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GemmaMLP(c)

    def forward(self, x, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        x = x + self.self_attn(self.input_layernorm(x), inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaTextModel(nn.Module):
    def __init__(self, c: GemmaConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList(GemmaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D], times sqrt(hidden) as a float32 scalar
        w = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5).to(w.dtype)

    def forward(self, embeds, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class PaliGemmaMultiModalProjector(nn.Module):
    def __init__(self, config: PaliGemmaConfig):
        super().__init__()
        self.linear = nn.Linear(config.vision.hidden_size, config.projection_dim)

    def forward(self, patches):  # f32[I,P,E] -> f32[I,P,D]
        return self.linear(patches)


class PaliGemmaModel(nn.Module):
    """transformers' PaliGemmaModel: `vision_tower`, `multi_modal_projector`, `language_model`, to hidden states."""

    def __init__(self, config: PaliGemmaConfig):
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionModel(config.vision)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(config)
        self.language_model = GemmaTextModel(config.text)

    def encode_images(self, pixel_values):  # f32[I,C,S,S] -> f32[I*P, D]
        return self.multi_modal_projector(self.vision_tower(pixel_values)).flatten(0, 1)

    def embed(self, input_ids):  # image ids past the vocabulary (the release's are not) embed as token 0
        c = self.config
        if c.image_token_id >= c.text.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == c.image_token_id, 0)
        return self.language_model.embed(input_ids)

    def forward(self, input_ids, attention_mask, token_type_ids=None, pixel_values=None, image_embeds=None):
        c = self.config
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            image_embeds = self.encode_images(pixel_values)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id)
        return self.language_model(embeds, layer_inputs(c, attention_mask, token_type_ids=token_type_ids))


class PaliGemmaForConditionalGeneration(nn.Module):
    """The in-memory tree: `model.vision_tower`, `model.multi_modal_projector`, `model.language_model`, `lm_head`
    (the embedding when tied, as the releases are)."""

    def __init__(self, config: PaliGemmaConfig):
        super().__init__()
        self.config = config
        self.model = PaliGemmaModel(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the scaled token embeddings (text only)
        return self.model.embed(input_ids)

    def encode_images(self, pixel_values):
        """f32[I,C,S,S] -> f32[I*(S/patch)^2, D]: the rows that replace the image tokens, image by image (the
        frozen tower's output: a trainer may compute it once per batch)."""
        return self.model.encode_images(pixel_values)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                return_hidden: bool = False, image_embeds=None):
        """input_ids i64[B,T], attention_mask i64[B,T] (right padding), pixel_values f32[I,C,S,S] (or image_embeds
        f32[n,D], encode_images' output), token_type_ids i64[B,T] (0: the bidirectional prefix; None: causal)
        -> logits f32[B,T,V] (and the final hidden states with return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, token_type_ids, pixel_values, image_embeds)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout, or transformers 5's save), fp32, eval."""
        return load_llava_layout(cls, PaliGemmaConfig.from_pretrained(path), path)
