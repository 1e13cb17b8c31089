"""Llama 3 / 3.1 in Flax Linen: the torch-free twin of torch_sources/models/llama3.py.

Same public names in the same order. Params are named after the HF checkpoint
(`params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]` = HF weight transposed);
see conversion/llama3.py. LoRA adapters ride in the separate "lora" collection, picked up
by every projection (jax_oracles/training/lora.py: LoraLinear).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.training.lora import LoraLinear

__all__ = [
    "RopeScaling", "LlamaConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM",
]


@dataclass(frozen=True)
class RopeScaling:
    """config.json `rope_scaling` of Llama 3.1 (rope_type "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])  # 3.1 configs omit it
        if "rope_parameters" in d and "rope_theta" not in d:  # transformers>=5 writes this form
            rope = dict(d["rope_parameters"])
            d["rope_theta"] = rope.pop("rope_theta")
            d["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        scaling = d.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "llama3"))
            assert scaling["rope_type"] == "llama3", f"unsupported rope_type {scaling['rope_type']}"
            d["rope_scaling"] = RopeScaling(**{f.name: scaling[f.name] for f in fields(RopeScaling)})
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "LlamaConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---- operators ------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]
    dtype = x.dtype
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(dtype)  # HF casts back before the weight multiply


def rope_inv_freq(config: LlamaConfig):  # -> f32[hd/2]
    # A config constant: computed in numpy float32 with the same op order as transformers'
    # `_compute_llama3_parameters`, so it is a literal under jit and matches torch to the ulp.
    f32, dim = np.float32, config.head_dim
    inv_freq = f32(1.0) / (f32(config.rope_theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))
    s = config.rope_scaling
    if s is not None:
        low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / s.factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, inv_freq_llama)
    return jnp.asarray(inv_freq, dtype=jnp.float32)


def rope_cos_sin(inv_freq, position_ids):  # f32[hd/2], i32[B,T] -> (cos, sin) f32[B,T,hd]
    freqs = position_ids[..., None].astype(jnp.float32) * inv_freq.astype(jnp.float32)  # f32[B,T,hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x, cos, sin):  # x: f32[B,T,N,hd]  cos, sin: f32[B,T,hd]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + _rotate_half(x) * sin


def causal_mask(attention_mask):  # i32[B,T] -> bool[B,T,T]; True = query t may attend key s
    T = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((T, T), dtype=jnp.bool_))
    return causal[None] & attention_mask.astype(jnp.bool_)[:, None, :]


def eager_attention(q, k, v, mask, scale: float):
    """q: f32[B,T,N,hd]  k, v: f32[B,S,K,hd]  mask: bool[B,T,S] -> f32[B,T,N,hd].

    Query head n = j*G + g uses KV head j (HF repeat_kv order); softmax in fp32.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


# ---- modules --------------------------------------------------------------------------------

class LlamaRMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):  # f32[..., D]
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        return rms_norm(x, weight, self.eps)


class LlamaMLP(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x):  # f32[B,T,D]
        c = self.config
        linear = functools.partial(LoraLinear, use_bias=c.mlp_bias, scaling=self.lora_scaling)
        gate = linear(c.intermediate_size, name="gate_proj")(x)
        up = linear(c.intermediate_size, name="up_proj")(x)
        return linear(c.hidden_size, name="down_proj")(jax.nn.silu(gate) * up)


class LlamaAttention(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x, mask, cos, sin):  # x: f32[B,T,D]  mask: bool[B,T,T]  cos, sin: f32[B,T,hd]
        c = self.config
        B, T, _ = x.shape
        N, K, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        linear = functools.partial(LoraLinear, use_bias=c.attention_bias, scaling=self.lora_scaling)
        q = linear(N * hd, name="q_proj")(x).reshape(B, T, N, hd)
        k = linear(K * hd, name="k_proj")(x).reshape(B, T, K, hd)
        v = linear(K * hd, name="v_proj")(x).reshape(B, T, K, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = eager_attention(q, k, v, mask, hd ** -0.5)  # [B,T,N,hd]
        return linear(c.hidden_size, name="o_proj")(out.reshape(B, T, N * hd))


class LlamaDecoderLayer(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, hidden, mask, cos, sin):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        attn_in = LlamaRMSNorm(c.rms_norm_eps, name="input_layernorm")(hidden)
        hidden = hidden + LlamaAttention(c, self.lora_scaling, name="self_attn")(attn_in, mask, cos, sin)
        mlp_in = LlamaRMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(hidden)
        return hidden + LlamaMLP(c, self.lora_scaling, name="mlp")(mlp_in)


class LlamaModel(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        c = self.config
        B, T = input_ids.shape
        if position_ids is None:  # right padding; left-padded generation passes HF's mask cumsum - 1
            position_ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        cos, sin = rope_cos_sin(rope_inv_freq(c), position_ids)
        mask = causal_mask(attention_mask)
        hidden = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(input_ids)
        for i in range(c.num_hidden_layers):
            hidden = LlamaDecoderLayer(c, self.lora_scaling, name=f"layers_{i}")(hidden, mask, cos, sin)
        return LlamaRMSNorm(c.rms_norm_eps, name="norm")(hidden)


class LlamaForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: LlamaConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = LlamaModel(c, self.lora_scaling, name="model")(input_ids, attention_mask, position_ids)
        if c.tie_word_embeddings:  # Llama 3.2 1B/3B: the embedding doubles as the output head
            logits = hidden @ self.variables["params"]["model"]["embed_tokens"]["embedding"].T
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(hidden)
        return (logits, hidden) if return_hidden else logits
