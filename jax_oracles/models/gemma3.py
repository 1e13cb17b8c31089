"""Gemma 3 (multimodal) in Flax Linen: the torch-free twin of torch_sources/models/gemma3.py.

The Gemma 3 decoder (sandwich norms, q/k norms, per-layer-type RoPE, GeGLU, sqrt(hidden) embedding scale, tied
head), the SigLIP tower (models/siglip.py) and the pooling projector, with the masks transformers builds from
token_type_ids (see the torch file's docstring). Same public names in the same order; params named like the
torch module tree (`model/language_model/layers_<i>/...`, `model/vision_tower/...`,
`model/multi_modal_projector/...`; conversion/gemma3.py maps the release's names). The decoder's projections
are LoraLinear layers, so adapters in a "lora" collection reach them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_oracles.models import rope
from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import (GatedMLP, LayerInputs, apply_rope, attend, causal_mask, default_positions,
                                      eager_attention, rope_cos_sin)
from jax_oracles.models.qwen2_vl import LanguageModelView, merge_image_embeddings
from jax_oracles.models.siglip import SiglipVisionConfig, SiglipVisionModel
from jax_oracles.training.lora import LoraLinear

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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def pool_kernel(self) -> int:  # patches a side per image token a side
        return self.vision.patches_per_side // int(self.mm_tokens_per_image ** 0.5)


    @property
    def sliding_window(self) -> int:
        return self.text.sliding_window


# ---- operators ------------------------------------------------------------------------------

def gemma_rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D] (stored as the offset from 1)
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


rms_norm = gemma_rms_norm  # the family's norm under the generic name (the checks read `rms_norm`): Gemma's 1 + w


def rope_inv_freq(config: Gemma3Config, layer_type: str = "full_attention"):  # -> f32[hd/2]
    """A layer type's table (models/rope.py); by default the full layers', which the release's rope_theta and
    rope_scaling describe (the sliding layers': layer_type="sliding_attention", rope_local_base_freq)."""
    return rope.inv_freq(config.text.layer_rope(layer_type))


def image_block_ids(token_type_ids):  # i32[B,T] -> i32[B,T]: k for the k-th run of 1s in the row, -1 elsewhere
    is_image = token_type_ids == 1
    previous = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = is_image & ~previous
    return jnp.where(is_image, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1)


def vision_masks(attention_mask, token_type_ids, sliding_window: int) -> dict:
    """i32[B,T], i32[B,T] | None -> {layer type: bool[B,T,T]}: transformers' create_masks_for_vision_model (the
    plain causal / sliding masks without token_type_ids)."""
    T = attention_mask.shape[1]
    idx = jnp.arange(T)
    allowed = (idx[None, :] <= idx[:, None])[None]
    if token_type_ids is not None:
        block = image_block_ids(token_type_ids)
        allowed = allowed | ((block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0))
    window = (idx[None, :] > idx[:, None] - sliding_window)[None]
    keys = attention_mask.astype(jnp.bool_)[:, None, :]
    return {"full_attention": allowed & keys, "sliding_attention": allowed & window & keys}


def layer_inputs(config: Gemma3Config, attention_mask, position_ids=None, *,
                 token_type_ids=None) -> dict[str, LayerInputs]:
    """{layer type: LayerInputs} every layer of a forward shares, each layer reading its own type's: that type's mask
    (vision_masks: with token_type_ids, the image blocks) and its own RoPE cos/sin of the positions (0..T-1 unless
    given). i32[B,T], i32[B,T] | None, i32[B,T] | None."""
    if position_ids is None:
        position_ids = default_positions(attention_mask)
    masks = vision_masks(attention_mask, token_type_ids, config.text.sliding_window)
    return {t: LayerInputs(masks[t], *rope.cos_sin(config.text.layer_rope(t), position_ids))
            for t in dict.fromkeys(config.text.layer_types)}


def _embed(table, input_ids, pad_token_id):  # f32[V,D], i32[B,T] -> f32[B,T,D]
    rows = table[input_ids]
    if pad_token_id is None:
        return rows
    # nn.Embedding(padding_idx=pad): the pad row takes no gradient
    return jnp.where((input_ids == pad_token_id)[..., None], jax.lax.stop_gradient(rows), rows)


# ---- modules --------------------------------------------------------------------------------

class Gemma3RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.zeros_init(), (x.shape[-1],), jnp.float32)
        return gemma_rms_norm(x, weight, self.eps)


def Gemma3MLP(config: Gemma3TextConfig, lora_scaling: float = 2.0, name: str | None = None) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation,
                    lora_scaling=lora_scaling, name=name)  # GeGLU (gelu_tanh)


class Gemma3Attention(nn.Module):
    """Layer `layer_idx`'s attention: its layer type picks its mask and RoPE table out of layer_inputs'."""
    config: Gemma3TextConfig
    lora_scaling: float = 2.0
    layer_idx: int = 0

    @nn.compact
    def __call__(self, x, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        c, (B, T, D) = self.config, x.shape
        linear = lambda f, name: LoraLinear(f, use_bias=c.attention_bias, scaling=self.lora_scaling, name=name)  # noqa: E731
        N, K, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = linear(N * hd, "q_proj")(x).reshape(B, T, N, hd)
        k = linear(K * hd, "k_proj")(x).reshape(B, T, K, hd)
        v = linear(K * hd, "v_proj")(x).reshape(B, T, K, hd)
        q = Gemma3RMSNorm(c.rms_norm_eps, name="q_norm")(q)
        k = Gemma3RMSNorm(c.rms_norm_eps, name="k_norm")(k)
        out = attend(q, k, v, inputs[c.layer_types[self.layer_idx]], c.query_pre_attn_scalar ** -0.5)
        return linear(D, "o_proj")(out)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""
    config: Gemma3TextConfig
    lora_scaling: float = 2.0
    layer_idx: int = 0

    @nn.compact
    def __call__(self, x, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        c = self.config
        norm = lambda name: Gemma3RMSNorm(c.rms_norm_eps, name=name)  # noqa: E731
        attn = Gemma3Attention(c, self.lora_scaling, self.layer_idx, name="self_attn")
        x = x + norm("post_attention_layernorm")(attn(norm("input_layernorm")(x), inputs))
        mlp = Gemma3MLP(c, self.lora_scaling, name="mlp")
        return x + norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(x)))


class Gemma3TextModel(nn.Module):
    config: Gemma3TextConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        self.layers = [Gemma3DecoderLayer(c, self.lora_scaling, i, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = Gemma3RMSNorm(c.rms_norm_eps)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D], times sqrt(hidden) as a float32 scalar
        c = self.config
        return _embed(self.embed_tokens.embedding, input_ids, c.pad_token_id) * jnp.float32(c.hidden_size ** 0.5)

    def __call__(self, embeds, inputs: dict[str, LayerInputs]):  # f32[B,T,D], layer_inputs' -> f32[B,T,D]
        for layer in self.layers:
            embeds = layer(embeds, inputs)
        return self.norm(embeds)


class Gemma3MultiModalProjector(nn.Module):
    config: Gemma3Config

    @nn.compact
    def __call__(self, patches):  # f32[I,P,E] -> f32[I,mm_tokens,D]: k x k average pools, row-major
        c = self.config
        I, _, E = patches.shape
        s, k = c.vision.patches_per_side, c.pool_kernel
        pooled = patches.reshape(I, s // k, k, s // k, k, E).mean(axis=(2, 4)).reshape(I, -1, E)
        weight = self.param("mm_input_projection_weight", nn.initializers.zeros_init(), (E, c.text.hidden_size),
                            jnp.float32)
        return Gemma3RMSNorm(c.vision.layer_norm_eps, name="mm_soft_emb_norm")(pooled) @ weight


class Gemma3Model(nn.Module):
    """transformers' Gemma3Model: `vision_tower`, `multi_modal_projector`, `language_model`, to hidden states."""
    config: Gemma3Config
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.vision_tower = SiglipVisionModel(c.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(c)
        self.language_model = Gemma3TextModel(c.text, self.lora_scaling)

    def encode_images(self, pixel_values):  # f32[I,C,S,S] -> f32[I*mm_tokens, D]
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


class Gemma3ForConditionalGeneration(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask, pixel_values,
    token_type_ids); the tree: `model/vision_tower`, `model/multi_modal_projector`, `model/language_model`
    (`lm_head` only when untied)."""
    config: Gemma3Config
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        c = self.config
        self.model = Gemma3Model(c, self.lora_scaling)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.text.vocab_size, use_bias=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D]: the scaled token embeddings (text only)
        return self.model.embed(input_ids)

    def encode_images(self, pixel_values):
        """f32[I,C,S,S] -> f32[I*mm_tokens_per_image, D]: the rows that replace the image tokens, image by image
        (the frozen tower's output: a trainer computes it once per batch, outside its jitted step)."""
        return self.model.encode_images(pixel_values)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                 return_hidden: bool = False, image_embeds=None):
        """input_ids i32[B,T], attention_mask i32[B,T] (right padding), pixel_values f32[I,C,S,S] (or image_embeds
        f32[n,D], encode_images' output; rows past the image tokens' count are never read), token_type_ids
        i32[B,T] (1 at image tokens; None: causal masks only) -> logits f32[B,T,V]."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, token_type_ids, pixel_values, image_embeds)
        if self.config.tie_word_embeddings:
            logits = hidden @ self.variables["params"]["model"]["language_model"]["embed_tokens"]["embedding"].T
        else:
            logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
