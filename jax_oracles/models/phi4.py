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

from jax_oracles.models import layers, llama3
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, KeyAudit
from jax_oracles.models.layers import (LayerInputs, RMSNorm, apply_rope, attend, causal_mask, eager_attention,
                                       rms_norm, rope_cos_sin)
from jax_oracles.models.llama3 import LlamaDecoderLayer, LlamaForCausalLM
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("phi3", "Phi3ForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "Phi3Config",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "split_qkv",
    "Phi3RMSNorm", "Phi3MLP", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "phi3",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                       "tie_word_embeddings", "partial_rotary_factor", "original_max_position_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT, "resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT},
    refused={"hidden_act": (("silu",), "SwiGLU is Phi-3's MLP"),
             "attention_bias": ((False, None), "transformers' Phi-3 has no projection biases (it does not read the key; "
                                               "Phi-4's release writes false)")})
# Phi3Config's own default: transformers takes longrope's original length from this attribute, not the dict.
ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096


@dataclass(frozen=True)
class Phi3Config:
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
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.rotary_dim % 2 == 0, self.rotary_dim

    @classmethod
    def from_hf(cls, d: dict) -> "Phi3Config":
        """Either config.json form; every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py:
        Phi-4's plain RoPE, Phi-4-mini's longrope with partial rotary 0.75 (the legacy types `su` and `yarn`
        are longrope, as transformers' Phi3Config reads them)."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the releases carry none; transformers: getattr(config, "head_dim")
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("original_max_position_embeddings", ORIGINAL_MAX_POSITION_EMBEDDINGS)
        d["rope"] = read_rope(d, d["head_dim"], partial_rotary=True, aliases={"su": "longrope", "yarn": "longrope"},
                              top_level_original=True, what="phi3 config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Phi3Config":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def partial_rotary_factor(self) -> float:
        return self.rope.partial_rotary_factor

    @property
    def rotary_dim(self) -> int:  # HF: int(head_dim * partial_rotary_factor)
        return self.rope.dim

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps


# ---- operators (the shared layers, at the config's settings) --------------------------------

rope_inv_freq, rope_attention_factor = llama3.rope_inv_freq, llama3.rope_attention_factor


def layer_inputs(config: Phi3Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope, sliding_window=config.sliding_window)


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
