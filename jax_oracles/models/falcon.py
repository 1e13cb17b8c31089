"""Falcon (7B multi-query, and the 40B/180B "new decoder architecture") in Flax Linen: the torch-free twin
of torch_sources/models/falcon.py.

Composed from the shared layers (jax_oracles/models/layers.py); same public names in the same order.
Params are named after the HF checkpoint (`params["transformer"]["h_0"]["self_attention"]
["query_key_value"]["kernel"]` = HF weight transposed); see conversion/falcon.py. What is Falcon's own:
the fused `query_key_value` split (`split_qkv`), the parallel block x + attn(ln(x)) + mlp(ln(x)) with one
shared norm or `ln_attn` / `ln_mlp`, the tied head. LoRA adapters ride in the "lora" collection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models import layers, rope
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from jax_oracles.models.layers import (LayerInputs, LayerNorm, PlainMLP, apply_rope, attend, causal_mask,
                                       eager_attention, layer_norm, rope_cos_sin)
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("falcon", "FalconForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "FalconConfig",
    "layer_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "split_qkv",
    "layer_inputs",
    "FalconLayerNorm", "FalconMLP", "FalconAttention", "FalconDecoderLayer", "FalconModel", "FalconForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "falcon",
    honored=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "layer_norm_epsilon",
                       "num_kv_heads", "new_decoder_architecture", "multi_query", "parallel_attn", "num_ln_in_parallel_attn",
                       "bias",
                       "ffn_hidden_size", "activation", "max_position_embeddings", "tie_word_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT, "hidden_dropout": DROPOUT,
             "apply_residual_connection_post_layernorm": "transformers' Falcon does not read it (an RW-era key)"},
    refused={"alibi": ((False, None), "ALiBi Falcon (falcon-rw) is not implemented")})


@dataclass(frozen=True)
class FalconConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rope: Rope
    layer_norm_epsilon: float = 1e-5
    num_kv_heads: int | None = None
    new_decoder_architecture: bool = False
    multi_query: bool = True
    parallel_attn: bool = True
    num_ln_in_parallel_attn: int | None = None
    bias: bool = False
    ffn_hidden_size: int | None = None
    activation: str = "gelu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not (self.new_decoder_architecture or self.parallel_attn):
            raise ConfigError("falcon config not supported by this source: parallel_attn=False (sequential blocks, "
                              "falcon-rw) is not implemented")
        if not self.new_decoder_architecture and self.num_ln_in_parallel_attn not in (None, 1):
            raise ConfigError(f"falcon config: num_ln_in_parallel_attn={self.num_ln_in_parallel_attn} needs "
                              f"new_decoder_architecture (as in transformers)")
        if self.activation not in layers.ACTIVATIONS:
            raise ConfigError(f"falcon config: activation={self.activation!r} (known: {sorted(layers.ACTIVATIONS)})")
        assert self.hidden_size % self.num_attention_heads == 0
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "FalconConfig":
        """Either config.json form; every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py
        (transformers' Falcon takes any rope type; theta 1e4 by default)."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        d["rope"] = read_rope(d, d["hidden_size"] // d["num_attention_heads"], what="falcon config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None})

    @classmethod
    def from_pretrained(cls, path) -> "FalconConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    # family-neutral names the generic checks read
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        if self.new_decoder_architecture:
            return self.num_kv_heads or self.num_attention_heads
        return 1 if self.multi_query else self.num_attention_heads

    @property
    def intermediate_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def num_parallel_norms(self) -> int:  # transformers: None means 2 under the new architecture
        if self.num_ln_in_parallel_attn is not None:
            return self.num_ln_in_parallel_attn
        return 2 if self.new_decoder_architecture else 1

    @property
    def norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def rope_theta(self) -> float:
        return self.rope.theta


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: FalconConfig):  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: FalconConfig) -> float:
    return rope.attention_factor(config.rope)


def split_qkv(config: FalconConfig, fused):  # f32[B,T,(N+2K)*hd] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
    """The fused projection's three layouts. Query head j*G+g belongs to KV group j (G = N/K)."""
    B, T, _ = fused.shape
    N, K, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if config.new_decoder_architecture:  # per KV group: G query heads, then its k, then its v
        qkv = fused.reshape(B, T, K, N // K + 2, hd)
        return qkv[:, :, :, :-2].reshape(B, T, N, hd), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if config.multi_query:  # [Q (all heads); K; V], one K/V head
        qkv = fused.reshape(B, T, N + 2, hd)
        return qkv[:, :, :N], qkv[:, :, N:N + 1], qkv[:, :, N + 1:]
    qkv = fused.reshape(B, T, N, 3, hd)  # per head [q, k, v]
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def layer_inputs(config: FalconConfig, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope)


# ---- modules --------------------------------------------------------------------------------

FalconLayerNorm = LayerNorm


def FalconMLP(config: FalconConfig, lora_scaling: float = 2.0, name: str | None = None) -> PlainMLP:
    return PlainMLP(config.hidden_size, config.intermediate_size, config.activation, config.bias,
                    names=("dense_h_to_4h", "dense_4h_to_h"), lora_scaling=lora_scaling, name=name)


class FalconAttention(nn.Module):
    config: FalconConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        linear = lambda f, name: LoraLinear(f, use_bias=c.bias, scaling=self.lora_scaling, name=name)
        self.query_key_value = linear((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
                                      "query_key_value")
        self.dense = linear(c.hidden_size, "dense")

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        return split_qkv(self.config, self.query_key_value(x))

    def __call__(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.dense(attend(*self.project_qkv(x), inputs, self.config.head_dim ** -0.5))


class FalconDecoderLayer(nn.Module):
    """Parallel block: x + (mlp(ln_mlp(x)) + attn(ln_attn(x))); with one norm both branches read input_layernorm(x)."""
    config: FalconConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        if c.num_parallel_norms == 2:
            attn_in = LayerNorm(c.layer_norm_epsilon, name="ln_attn")(hidden)
            mlp_in = LayerNorm(c.layer_norm_epsilon, name="ln_mlp")(hidden)
        else:
            attn_in = mlp_in = LayerNorm(c.layer_norm_epsilon, name="input_layernorm")(hidden)
        attn_out = FalconAttention(c, self.lora_scaling, name="self_attention")(attn_in, inputs)
        mlp_out = FalconMLP(c, self.lora_scaling, name="mlp")(mlp_in)
        # HF's order of the sums: mlp_output += attention_output; residual + mlp_output
        return hidden + (mlp_out + attn_out)


class FalconModel(nn.Module):
    config: FalconConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        c = self.config
        inputs = layer_inputs(c, attention_mask, position_ids)
        hidden = nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
        for i in range(c.num_hidden_layers):
            hidden = FalconDecoderLayer(c, self.lora_scaling, name=f"h_{i}")(hidden, inputs)
        return LayerNorm(c.layer_norm_epsilon, name="ln_f")(hidden)


class FalconForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: FalconConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = FalconModel(c, self.lora_scaling, name="transformer")(input_ids, attention_mask, position_ids)
        if c.tie_word_embeddings:  # the released Falcons: the embedding doubles as the output head
            logits = hidden @ self.variables["params"]["transformer"]["word_embeddings"]["embedding"].T
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(hidden)
        return (logits, hidden) if return_hidden else logits
