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

from jax_oracles.models import layers
from jax_oracles.models.layers import (GatedMLP, LayerInputs, RMSNorm, RopeScaling, apply_rope, attend,
                                       causal_mask, eager_attention, rms_norm, rope_cos_sin)
from jax_oracles.training.lora import LoraLinear

__all__ = [
    "RopeScaling", "LlamaConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM",
]


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

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: LlamaConfig):  # -> f32[hd/2]
    return layers.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def layer_inputs(config: LlamaConfig, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config))


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
