"""StarCoder2 in Flax Linen: the torch-free twin of torch_sources/models/starcoder2.py.

Composed from the shared layers (jax_oracles/models/layers.py): biased LayerNorms, biased q/k/v/o,
the plain biased MLP `c_fc` -> gelu_pytorch_tanh -> `c_proj`, RoPE, a sliding window on every layer,
and the output head tied to the embedding. Same public names in the same order. Params are named after
the HF checkpoint (`params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]` = HF weight
transposed); see conversion/starcoder2.py.
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

AUTO_MODEL = ("starcoder2", "Starcoder2ForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "Starcoder2Config",
    "layer_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "Starcoder2MLP", "Starcoder2Attention", "Starcoder2DecoderLayer", "Starcoder2Model", "Starcoder2ForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "starcoder2",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "norm_epsilon", "max_position_embeddings", "sliding_window",
                       "use_bias", "tie_word_embeddings", "hidden_act"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT, "embedding_dropout": DROPOUT, "residual_dropout": DROPOUT},
    refused={"mlp_type": (("default", None), "transformers' StarCoder2 has one MLP, c_fc -> act -> c_proj (it does not "
                                             "read the key; the releases write \"default\")")})


@dataclass(frozen=True)
class Starcoder2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_epsilon: float
    rope: Rope
    max_position_embeddings: int
    sliding_window: int | None = None
    use_bias: bool = True
    tie_word_embeddings: bool = True  # transformers' default; starcoder2-3b's config.json leaves it out
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_act not in layers.ACTIVATIONS:
            raise ConfigError(f"starcoder2 config: hidden_act={self.hidden_act!r} (known: {sorted(layers.ACTIVATIONS)})")
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Starcoder2Config":
        """Either config.json form; every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the releases carry none; transformers: getattr(config, "head_dim")
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["rope"] = read_rope(d, d["head_dim"], what="starcoder2 config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Starcoder2Config":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.norm_epsilon


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Starcoder2Config):  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: Starcoder2Config) -> float:
    return rope.attention_factor(config.rope)


def layer_inputs(config: Starcoder2Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope, sliding_window=config.sliding_window)


# ---- modules --------------------------------------------------------------------------------

def Starcoder2MLP(config: Starcoder2Config, lora_scaling: float = 2.0, name: str | None = None) -> PlainMLP:
    return PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.use_bias,
                    names=("c_fc", "c_proj"), lora_scaling=lora_scaling, name=name)


class Starcoder2Attention(nn.Module):
    config: Starcoder2Config
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        linear = lambda f, name: LoraLinear(f, use_bias=c.use_bias, scaling=self.lora_scaling, name=name)
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


class Starcoder2DecoderLayer(nn.Module):
    """Pre-norm block with biased LayerNorms: x + attn(ln(x)), then x + mlp(ln(x))."""
    config: Starcoder2Config
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        attn_in = LayerNorm(c.norm_epsilon, name="input_layernorm")(hidden)
        hidden = hidden + Starcoder2Attention(c, self.lora_scaling, name="self_attn")(attn_in, inputs)
        mlp_in = LayerNorm(c.norm_epsilon, name="post_attention_layernorm")(hidden)
        return hidden + Starcoder2MLP(c, self.lora_scaling, name="mlp")(mlp_in)


class Starcoder2Model(nn.Module):
    config: Starcoder2Config
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        c = self.config
        inputs = layer_inputs(c, attention_mask, position_ids)
        hidden = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(input_ids)
        for i in range(c.num_hidden_layers):
            hidden = Starcoder2DecoderLayer(c, self.lora_scaling, name=f"layers_{i}")(hidden, inputs)
        return LayerNorm(c.norm_epsilon, name="norm")(hidden)


class Starcoder2ForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: Starcoder2Config
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        c = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = Starcoder2Model(c, self.lora_scaling, name="model")(input_ids, attention_mask, position_ids)
        if c.tie_word_embeddings:  # the embedding doubles as the output head
            logits = hidden @ self.variables["params"]["model"]["embed_tokens"]["embedding"].T
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(hidden)
        return (logits, hidden) if return_hidden else logits
