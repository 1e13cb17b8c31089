"""Llama 3 / 3.1 in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_llama.py composed from the shared layers (models/layers.py): pre-norm RMSNorm
blocks, RoPE of any type transformers applies (models/rope.py; the releases use llama3 scaling), GQA eager attention, SwiGLU. What is Llama's own: the config keys and
the checkpoint names. Submodule names equal the HF state-dict keys, so a checkpoint loads with
load_state_dict. The other Llama-shaped families (Mistral, Qwen2, Qwen3) reuse this file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from torch_sources.models import layers, rope
from torch_sources.models.config_keys import DROPOUT, ROPE_KEYS, KeyAudit
from torch_sources.models.layers import (GatedMLP, LayerInputs, RMSNorm, apply_rope, attend, causal_mask,
                                         eager_attention, rms_norm, rope_cos_sin)
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.rope import Rope, read_rope

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
        return cls.from_hf(load_config(path))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def rope_theta(self) -> float:
        return self.rope.theta


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config) -> torch.Tensor:  # -> f32[rotary_dim/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config) -> float:  # YaRN's or longrope's cos/sin multiplier, else 1.0
    return rope.attention_factor(config.rope)


def layer_inputs(config, attention_mask, position_ids=None) -> LayerInputs:
    """The mask and cos/sin every layer shares (Qwen2 and Qwen3 share it too)."""
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope)


# ---- modules --------------------------------------------------------------------------------

LlamaRMSNorm = RMSNorm


def LlamaMLP(config: LlamaConfig) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        D, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=bias)

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.o_proj(attend(*self.project_qkv(x), inputs, self.head_dim ** -0.5))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `attention` and `feed_forward` build the
    family's attention and MLP (Phi-3/4: fused qkv and gate/up projections)."""

    def __init__(self, config: LlamaConfig, attention=LlamaAttention, feed_forward=LlamaMLP):
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = feed_forward(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config, decoder_layer=LlamaDecoderLayer, layer_inputs_fn=None):
        super().__init__()
        self.config = config
        self.layer_inputs_fn = layer_inputs_fn or layer_inputs
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        # Recomputed per call (a few floats) rather than stored, so a meta-device build stays valid.
        inputs = self.layer_inputs_fn(self.config, attention_mask, position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, inputs)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Also the causal LM of the Llama-shaped families: they pass their config and decoder layer."""

    def __init__(self, config, decoder_layer=LlamaDecoderLayer, layer_inputs_fn=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, decoder_layer, layer_inputs_fn)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode."""
        return load_pretrained(cls, LlamaConfig.from_pretrained(path), path)
