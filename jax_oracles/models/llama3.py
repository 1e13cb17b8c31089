"""Llama 3 / 3.1 in Flax Linen: the torch-free twin of torch_sources/models/llama3.py.

Composed from the shared layers (jax_oracles/models/layers.py); Mistral, Qwen2 and Qwen3 reuse its
blocks. Same public names in the same order. Params are named after the HF checkpoint
(`params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]` = HF weight transposed);
see conversion/llama3.py. LoRA adapters ride in the separate "lora" collection, picked up
by every projection (jax_oracles/training/lora.py: LoraLinear).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models import layers, rope
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, KeyAudit
from jax_oracles.models.layers import (GatedMLP, LayerInputs, RMSNorm, apply_rope, attend, causal_mask,
                                       eager_attention, rms_norm, rope_cos_sin)
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("llama", "LlamaForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "LlamaConfig",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM",
]


# Every key of transformers' LlamaConfig and of the releases' config.json (models/config_keys.py).
CONFIG_KEYS = KeyAudit(
    "llama",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                       "tie_word_embeddings", "attention_bias", "mlp_bias"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT, "pretraining_tp": "transformers 5.24's Llama does not read it (Llama 2's sliced matmuls, "
             "the same sums)"},
    refused={"hidden_act": (("silu",), "SwiGLU is Llama's MLP")})


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
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """Either config.json form (the release's `rope_theta` + `rope_scaling`, transformers 5's
        `rope_parameters`); every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # 3.1 configs omit it
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["rope"] = read_rope(d, d["head_dim"], what="llama config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "LlamaConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def rope_theta(self) -> float:
        return self.rope.theta


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config):  # -> f32[rotary_dim/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config) -> float:  # YaRN's or longrope's cos/sin multiplier, else 1.0
    return rope.attention_factor(config.rope)


def layer_inputs(config, attention_mask, position_ids=None) -> LayerInputs:
    """The mask and cos/sin every layer shares (Qwen2 and Qwen3 share it too)."""
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope)


# ---- modules --------------------------------------------------------------------------------

LlamaRMSNorm = RMSNorm


def LlamaMLP(config: LlamaConfig, lora_scaling: float = 2.0, name: str | None = None) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias,
                    lora_scaling=lora_scaling, name=name)


class LlamaAttention(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        linear = lambda f, name: LoraLinear(f, use_bias=c.attention_bias, scaling=self.lora_scaling, name=name)
        hd = c.head_dim
        self.q_proj = linear(c.num_attention_heads * hd, "q_proj")
        self.k_proj = linear(c.num_key_value_heads * hd, "k_proj")
        self.v_proj = linear(c.num_key_value_heads * hd, "v_proj")
        self.o_proj = linear(c.hidden_size, "o_proj")

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(B, T, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(B, T, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def __call__(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.o_proj(attend(*self.project_qkv(x), inputs, self.config.head_dim ** -0.5))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `attention` and `feed_forward` build the
    family's attention and MLP (Phi-3/4: fused qkv and gate/up projections)."""
    config: LlamaConfig
    lora_scaling: float = 2.0
    attention: type = LlamaAttention
    feed_forward: object = LlamaMLP  # (config, lora_scaling, name=) -> the MLP module

    @nn.compact
    def __call__(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        attn_in = RMSNorm(c.rms_norm_eps, name="input_layernorm")(hidden)
        hidden = hidden + self.attention(c, self.lora_scaling, name="self_attn")(attn_in, inputs)
        mlp_in = RMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(hidden)
        return hidden + self.feed_forward(c, self.lora_scaling, name="mlp")(mlp_in)


class LlamaModel(nn.Module):
    config: LlamaConfig
    lora_scaling: float = 2.0
    decoder_layer: type = LlamaDecoderLayer
    layer_inputs_fn: object = None

    @nn.compact
    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        c = self.config
        inputs = (self.layer_inputs_fn or layer_inputs)(c, attention_mask, position_ids)
        hidden = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(input_ids)
        for i in range(c.num_hidden_layers):
            hidden = self.decoder_layer(c, self.lora_scaling, name=f"layers_{i}")(hidden, inputs)
        return RMSNorm(c.rms_norm_eps, name="norm")(hidden)


class LlamaForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask).
    Also the causal LM of the Llama-shaped families: they pass their config and decoder layer."""
    config: LlamaConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given
    decoder_layer: type = LlamaDecoderLayer
    layer_inputs_fn: object = None

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = LlamaModel(c, self.lora_scaling, self.decoder_layer, self.layer_inputs_fn,
                            name="model")(input_ids, attention_mask, position_ids)
        if c.tie_word_embeddings:  # Llama 3.2 1B/3B: the embedding doubles as the output head
            logits = hidden @ self.variables["params"]["model"]["embed_tokens"]["embedding"].T
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(hidden)
        return (logits, hidden) if return_hidden else logits
