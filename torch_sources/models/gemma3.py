"""Gemma 3 (multimodal) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers 5.24's Gemma3ForConditionalGeneration (gemma3/modeling_gemma3.py):
- the Gemma 3 decoder: sandwich norms (input / post-attention / pre-feedforward / post-feedforward), each an
  RMSNorm computing x_hat * (1 + w) in fp32; q_norm / k_norm (the same norm over head_dim) before RoPE; scores
  scaled by query_pre_attn_scalar^-1/2; GeGLU (gelu_tanh); sliding and full layers from layer_types, each type
  with its own RoPE (the release's `rope_scaling` + `rope_theta` are the full layers', `rope_local_base_freq` the
  sliding ones'; transformers 5 writes `rope_parameters` per layer type); the embedding scaled by sqrt(hidden),
  the scale a float32 scalar cast to the weight's dtype; the head tied to the embedding;
- the SigLIP tower (models/siglip.py) and Gemma3MultiModalProjector: the tower's patches average-pooled to
  mm_tokens_per_image, mm_soft_emb_norm (the Gemma norm, eps = the tower's layer_norm_eps), then
  `@ mm_input_projection_weight` (stored [in, out]); the rows replace the `<image_soft_token>`s (after the scaling:
  image features enter unscaled), which the prompt frames as `<start_of_image> <image_soft_token>*n <end_of_image>`;
- the masks transformers builds from token_type_ids (1 at image tokens, as the processor and LLaMA-Factory give
  them; a run of consecutive 1s is one image): full layers OR(causal, same image), sliding layers
  AND(key > query - window, OR(causal, same image)), and padding keys masked in both. Without token_type_ids
  the masks are the plain causal / sliding ones (transformers' create_masks_for_generate). The training forward
  (LLaMA-Factory: train mode, dropout 0, labels passed) takes the same path: 5.24 reads labels only for the loss.
`layer_inputs` gives every layer type its LayerInputs (that type's mask and RoPE cos/sin), {layer type: LayerInputs};
each decoder layer reads its own type's, so any layer runs as `layer(hidden, inputs)` (the generic checks' call).
Gemma3ForConditionalGeneration applies no final logit soft-capping (only the text-only Gemma3ForCausalLM does)
and its attention passes no attn_logit_softcapping: both keys are ignored here as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models import rope
from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import (GatedMLP, LayerInputs, apply_rope, attend, causal_mask, default_positions,
                                         eager_attention, rope_cos_sin)
from torch_sources.models.loading import load_config
from torch_sources.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from torch_sources.models.siglip import SiglipVisionConfig, SiglipVisionModel, load_llava_layout

AUTO_MODEL = ("gemma3", "Gemma3ForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_KEYS", "Gemma3TextConfig", "Gemma3Config",
    "gemma_rms_norm", "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "image_block_ids", "vision_masks", "layer_inputs", "merge_image_embeddings",
    "Gemma3RMSNorm", "Gemma3MLP", "Gemma3Attention", "Gemma3DecoderLayer", "Gemma3TextModel",
    "Gemma3MultiModalProjector", "Gemma3Model", "Gemma3ForConditionalGeneration",
]

# text_config's keys (Gemma3TextConfig's, and what the releases write: the legacy RoPE keys, the pattern).
TEXT_KEYS = KeyAudit(
    "gemma3 text",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps", "query_pre_attn_scalar",
                       "sliding_window", "layer_types", "sliding_window_pattern", "rope_parameters", "rope_scaling",
                       "rope_theta", "rope_local_base_freq", "attention_bias", "max_position_embeddings"}),
    ignored={"attention_dropout": DROPOUT,
             "final_logit_softcapping": "Gemma3ForConditionalGeneration does not apply it (Gemma3ForCausalLM does)",
             "attn_logit_softcapping": "Gemma3Attention passes no softcap to its attention",
             "_sliding_window_pattern": "transformers 5 writes it beside layer_types, which it derives",
             "cache_implementation": "generate's cache class: the same numbers",
             "tie_word_embeddings": "transformers ties on the top-level key"},
    refused={"use_bidirectional_attention": ((False, None), "EmbeddingGemma's bidirectional text attention")})

CONFIG_KEYS = KeyAudit(
    "gemma3",
    honored=frozenset({"text_config", "vision_config", "mm_tokens_per_image", "image_token_index",
                       "tie_word_embeddings"}),
    ignored={"boi_token_index": "frames an image in the prompt; the forward reads only the image tokens",
             "eoi_token_index": "frames an image in the prompt; the forward reads only the image tokens"})

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


@dataclass(frozen=True)
class Gemma3TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_full: rope.Rope
    rope_sliding: rope.Rope
    max_position_embeddings: int = 131_072
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    pad_token_id: int | None = 0

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers or \
                set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise ConfigError(f"gemma3 text config: layer_types={list(self.layer_types)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("gemma3 text config: num_attention_heads is not a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, d: dict) -> "Gemma3TextConfig":
        """Gemma3TextConfig's defaults under the keys given (the releases omit most of them)."""
        TEXT_KEYS.check(d)
        L = d.get("num_hidden_layers", 26)
        head_dim = d.get("head_dim", 256)
        pattern = d.get("sliding_window_pattern", 6)
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(L)]
        ropes = read_ropes(d, head_dim)
        return cls(vocab_size=d.get("vocab_size", 262_208), hidden_size=d.get("hidden_size", 2304),
                   intermediate_size=d.get("intermediate_size", 9216), num_hidden_layers=L,
                   num_attention_heads=d.get("num_attention_heads", 8),
                   num_key_value_heads=d.get("num_key_value_heads", 4), head_dim=head_dim,
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
                   sliding_window=d.get("sliding_window", 4096), layer_types=tuple(types),
                   rope_full=ropes["full_attention"], rope_sliding=ropes["sliding_attention"],
                   max_position_embeddings=d.get("max_position_embeddings", 131_072),
                   hidden_activation=d.get("hidden_activation", "gelu_pytorch_tanh"),
                   attention_bias=bool(d.get("attention_bias", False)), pad_token_id=d.get("pad_token_id", 0))

    def layer_rope(self, layer_type: str) -> rope.Rope:
        return self.rope_full if layer_type == "full_attention" else self.rope_sliding


def read_ropes(d: dict, head_dim: int) -> dict[str, rope.Rope]:
    """{layer type: Rope} as Gemma3TextConfig.convert_rope_params_to_dict resolves it: transformers 5's
    per-type rope_parameters, the release's rope_scaling merged into the full layers' block, rope_theta the full
    layers' theta and rope_local_base_freq the sliding ones' (each only where the block has none)."""
    given = d.get("rope_parameters") or {}
    if set(given) - set(DEFAULT_THETA):
        raise ConfigError(f"gemma3 text config: rope_parameters={given!r} (one block per layer type expected)")
    blocks = {t: dict(given.get(t) or {"rope_type": "default"}) for t in DEFAULT_THETA}
    blocks["full_attention"].update(d.get("rope_scaling") or {})
    legacy = {"full_attention": d.get("rope_theta"), "sliding_attention": d.get("rope_local_base_freq")}
    for t, block in blocks.items():
        block.setdefault("rope_theta", DEFAULT_THETA[t] if legacy[t] is None else legacy[t])
    longest = d.get("max_position_embeddings", 131_072)
    return {t: rope.read_rope({"rope_parameters": block, "max_position_embeddings": longest}, head_dim,
                              what=f"gemma3 rope_parameters[{t!r}]") for t, block in blocks.items()}


@dataclass(frozen=True)
class Gemma3Config(LanguageModelView):
    text: Gemma3TextConfig
    vision: SiglipVisionConfig
    mm_tokens_per_image: int
    image_token_id: int
    tie_word_embeddings: bool = True

    def __post_init__(self):
        side = int(self.mm_tokens_per_image ** 0.5)
        if side * side != self.mm_tokens_per_image or self.vision.patches_per_side % side:
            raise ConfigError(f"gemma3 config: mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose "
                              f"side divides the {self.vision.patches_per_side} patches a side")

    @classmethod
    def from_hf(cls, d: dict) -> "Gemma3Config":
        """Either form of config.json: the release's (text_config with rope_scaling, most keys left to defaults)
        or transformers 5's (rope_parameters per layer type, layer_types)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"gemma3 config: no {key} (Gemma 3 nests both towers' keys)")
        return cls(text=Gemma3TextConfig.from_hf(d["text_config"]),
                   vision=SiglipVisionConfig.from_hf(d["vision_config"]),
                   mm_tokens_per_image=int(d.get("mm_tokens_per_image", 256)),
                   image_token_id=int(d.get("image_token_index", 262_144)),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))

    @classmethod
    def from_pretrained(cls, path) -> "Gemma3Config":
        return cls.from_hf(load_config(path))

    @property
    def pool_kernel(self) -> int:  # patches a side per image token a side
        return self.vision.patches_per_side // int(self.mm_tokens_per_image ** 0.5)


    @property
    def sliding_window(self) -> int:
        return self.text.sliding_window


# ---- operators ------------------------------------------------------------------------------

def gemma_rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D] (stored as the offset from 1)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


rms_norm = gemma_rms_norm  # the family's norm under the generic name (the checks read `rms_norm`): Gemma's 1 + w


def rope_inv_freq(config: Gemma3Config, layer_type: str = "full_attention") -> torch.Tensor:  # -> f32[hd/2]
    """A layer type's table (models/rope.py); by default the full layers', which the release's rope_theta and
    rope_scaling describe (the sliding layers': layer_type="sliding_attention", rope_local_base_freq)."""
    return rope.inv_freq(config.text.layer_rope(layer_type))


def image_block_ids(token_type_ids):  # i64[B,T] -> i64[B,T]: k for the k-th run of 1s in the row, -1 elsewhere
    is_image = token_type_ids == 1
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, torch.cumsum(starts.long(), dim=1) - 1, -1)


def vision_masks(attention_mask, token_type_ids, sliding_window: int) -> dict[str, torch.Tensor]:
    """i64[B,T], i64[B,T] | None -> {layer type: bool[B,T,T]}: transformers' create_masks_for_vision_model (the
    plain causal / sliding masks without token_type_ids)."""
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    allowed = (idx[None, :] <= idx[:, None])[None]
    if token_type_ids is not None:
        block = image_block_ids(token_type_ids)
        allowed = allowed | ((block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0))
    window = (idx[None, :] > idx[:, None] - sliding_window)[None]
    keys = attention_mask.bool()[:, None, :]
    return {"full_attention": allowed & keys, "sliding_attention": allowed & window & keys}


def layer_inputs(config: Gemma3Config, attention_mask, position_ids=None, *,
                 token_type_ids=None) -> dict[str, LayerInputs]:
    """{layer type: LayerInputs} every layer of a forward shares, each layer reading its own type's: that type's mask
    (vision_masks: with token_type_ids, the image blocks) and its own RoPE cos/sin of the positions (0..T-1 unless
    given). i64[B,T], i64[B,T] | None, i64[B,T] | None."""
    if position_ids is None:
        position_ids = default_positions(attention_mask)
    masks = vision_masks(attention_mask, token_type_ids, config.text.sliding_window)
    return {t: LayerInputs(masks[t], *rope.cos_sin(config.text.layer_rope(t), position_ids))
            for t in dict.fromkeys(config.text.layer_types)}


# ---- modules --------------------------------------------------------------------------------

class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return gemma_rms_norm(x, self.weight, self.eps)


def Gemma3MLP(config: Gemma3TextConfig) -> GatedMLP:  # GeGLU (gelu_tanh)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)


class Gemma3Attention(nn.Module):
    """Layer `layer_idx`'s attention: its layer type picks its mask and RoPE table out of layer_inputs'."""

    def __init__(self, c: Gemma3TextConfig, layer_idx: int = 0):
        super().__init__()
        self.c, self.layer_type = c, c.layer_types[layer_idx]
        D, hd, bias = c.hidden_size, c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(D, c.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, c.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, c.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, D, bias=bias)
        self.q_norm = Gemma3RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(hd, c.rms_norm_eps)

    def forward(self, x, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        c, (B, T, _) = self.c, x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        return self.o_proj(attend(q, k, v, inputs[self.layer_type], c.query_pre_attn_scalar ** -0.5))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, c: Gemma3TextConfig, layer_idx: int = 0):
        super().__init__()
        D, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = Gemma3Attention(c, layer_idx)
        self.mlp = Gemma3MLP(c)
        self.input_layernorm = Gemma3RMSNorm(D, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(D, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(D, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(D, eps)

    def forward(self, x, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), inputs))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, c: Gemma3TextConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Gemma3RMSNorm(c.hidden_size, c.rms_norm_eps)

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D], times sqrt(hidden) as a float32 scalar
        w = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5).to(w.dtype)

    def forward(self, embeds, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.kernel, self.side = config.pool_kernel, config.vision.patches_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(config.vision.hidden_size, config.text.hidden_size))
        self.mm_soft_emb_norm = Gemma3RMSNorm(config.vision.hidden_size, config.vision.layer_norm_eps)

    def forward(self, patches):  # f32[I,P,E] -> f32[I,mm_tokens,D]: k x k average pools, row-major
        I, _, E = patches.shape
        grid = patches.transpose(1, 2).reshape(I, E, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3Model(nn.Module):
    """transformers' Gemma3Model: `vision_tower`, `multi_modal_projector`, `language_model`, to hidden states."""

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionModel(config.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3TextModel(config.text)

    def encode_images(self, pixel_values):  # f32[I,C,S,S] -> f32[I*mm_tokens, D]
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


class Gemma3ForConditionalGeneration(nn.Module):
    """The in-memory tree: `model.vision_tower`, `model.multi_modal_projector`, `model.language_model`, `lm_head`
    (the embedding when tied, as every release is)."""

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the scaled token embeddings (text only)
        return self.model.embed(input_ids)

    def encode_images(self, pixel_values):
        """f32[I,C,S,S] -> f32[I*mm_tokens_per_image, D]: the rows that replace the image tokens, image by image
        (the frozen tower's output: a trainer may compute it once per batch)."""
        return self.model.encode_images(pixel_values)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                return_hidden: bool = False, image_embeds=None):
        """input_ids i64[B,T], attention_mask i64[B,T] (right padding), pixel_values f32[I,C,S,S] (or image_embeds
        f32[n,D], encode_images' output), token_type_ids i64[B,T] (1 at image tokens; None: causal masks only)
        -> logits f32[B,T,V] (and the final hidden states with return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, token_type_ids, pixel_values, image_embeds)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release layout, or transformers 5's save), fp32, eval."""
        return load_llava_layout(cls, Gemma3Config.from_pretrained(path), path)
