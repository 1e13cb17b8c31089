"""Phi-4 (HF model_type "phi3") in Flax Linen: the torch-free twin of torch_sources/models/phi4.py.

Llama's blocks (jax_oracles/models/llama3.py) with Phi's own pieces: the fused `qkv_proj` (rows
[Q | K | V]), the fused `gate_up_proj` (first half gate: down(up * silu(gate))) and partial rotary
(the first rotary_dim channels of each head rotate, the rest pass through). Default RoPE only (no
longrope). Same public names in the same order; params named after the HF checkpoint
(`params["model"]["layers_0"]["self_attn"]["qkv_proj"]["kernel"]` = HF weight transposed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models import layers
from jax_oracles.models.layers import (LayerInputs, RMSNorm, apply_rope, attend, causal_mask, eager_attention,
                                       rms_norm, rope_cos_sin)
from jax_oracles.models.llama3 import LlamaDecoderLayer, LlamaForCausalLM
from jax_oracles.training.lora import LoraLinear

__all__ = [
    "Phi3Config",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "split_qkv",
    "Phi3RMSNorm", "Phi3MLP", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM",
]


@dataclass(frozen=True)
class Phi3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.rotary_dim % 2 == 0, self.rotary_dim

    @classmethod
    def from_hf(cls, d: dict) -> "Phi3Config":
        d = dict(d)
        if "rope_parameters" in d and "rope_theta" not in d:  # transformers>=5 writes this form
            rope = dict(d["rope_parameters"])
            d["rope_theta"] = rope["rope_theta"]
            d["partial_rotary_factor"] = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            d["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        if d.get("rope_scaling") is not None:
            raise ValueError(f"unsupported rope_scaling {d['rope_scaling']} (only the default RoPE; no longrope)")
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Phi3Config":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def head_dim(self) -> int:  # Phi-3/4 configs carry no head_dim key
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:  # HF: int(head_dim * partial_rotary_factor)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Phi3Config):  # -> f32[rotary_dim/2]
    return layers.rope_inv_freq(config.rotary_dim, config.rope_theta)


def layer_inputs(config: Phi3Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config),
                               sliding_window=config.sliding_window)


def split_qkv(config: Phi3Config, fused):  # f32[B,T,(N+2K)*hd] -> q [B,T,N,hd], k, v [B,T,K,hd]
    """The fused projection's output rows are [Q | K | V], each head's channels contiguous."""
    N, K, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B, T, _ = fused.shape
    q, k, v = jnp.split(fused, (N * hd, (N + K) * hd), axis=-1)
    return q.reshape(B, T, N, hd), k.reshape(B, T, K, hd), v.reshape(B, T, K, hd)


# ---- modules --------------------------------------------------------------------------------

Phi3RMSNorm = RMSNorm


class Phi3MLP(nn.Module):
    """down(up * silu(gate)) with gate and up from one fused projection: rows [gate | up]."""
    config: Phi3Config
    lora_scaling: float = 2.0

    def activation(self, x):  # HF's hidden_act by name (the L1 `activation` check calls it alone)
        return layers.ACTIVATIONS[self.config.hidden_act](x)

    @nn.compact
    def __call__(self, x):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        gate_up = LoraLinear(2 * c.intermediate_size, scaling=self.lora_scaling, name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return LoraLinear(c.hidden_size, scaling=self.lora_scaling, name="down_proj")(up * self.activation(gate))


class Phi3Attention(nn.Module):
    config: Phi3Config
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        N, K, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_proj = LoraLinear((N + 2 * K) * hd, scaling=self.lora_scaling, name="qkv_proj")
        self.o_proj = LoraLinear(c.hidden_size, scaling=self.lora_scaling, name="o_proj")

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        return split_qkv(self.config, self.qkv_proj(x))

    def __call__(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.o_proj(attend(*self.project_qkv(x), inputs, self.config.head_dim ** -0.5))


def Phi3DecoderLayer(config: Phi3Config, lora_scaling: float = 2.0, name: str | None = None) -> LlamaDecoderLayer:
    """Llama's pre-norm block with Phi's fused attention and MLP."""
    return LlamaDecoderLayer(config, lora_scaling, attention=Phi3Attention, feed_forward=Phi3MLP, name=name)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's causal LM (embed_tokens, layers, norm, untied lm_head as Phi-4) over Phi3DecoderLayer.
    logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: Phi3Config
    lora_scaling: float = 2.0
    decoder_layer: object = Phi3DecoderLayer
    layer_inputs_fn: object = layer_inputs
