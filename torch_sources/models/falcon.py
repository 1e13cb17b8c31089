"""Falcon (7B multi-query, and the 40B/180B "new decoder architecture") in pure PyTorch, eager fp32.

transformers' modeling_falcon.py composed from the shared layers (models/layers.py). What is Falcon's own:
- one fused `query_key_value` projection, split three ways by the config (`split_qkv`):
  new architecture: per KV group [q x N/K, k, v]; multi-query (7B): [Q (all heads); K; V], one K/V head;
  plain multi-head: per head [q, k, v];
- a parallel block, x + attn(ln(x)) + mlp(ln(x)): one shared `input_layernorm`, or (new architecture)
  `ln_attn` and `ln_mlp` reading the same x;
- RoPE of any type transformers applies (models/rope.py; theta 1e4 by default; ALiBi Falcons are refused), a plain GELU MLP
  `dense_h_to_4h -> gelu (exact erf) -> dense_4h_to_h`, biased LayerNorms, tied head.
HF's eager softmax runs in the activation dtype (fp32 here, so the shared fp32 softmax is the same).
Submodule names equal the HF state-dict keys, so a checkpoint loads with load_state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from torch_sources.models import layers, rope
from torch_sources.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from torch_sources.models.layers import (LayerInputs, LayerNorm, PlainMLP, apply_rope, attend, causal_mask,
                                         eager_attention, layer_norm, rope_cos_sin)
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.rope import Rope, read_rope

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
        return cls.from_hf(load_config(path))

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

def rope_inv_freq(config: FalconConfig) -> torch.Tensor:  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: FalconConfig) -> float:
    return rope.attention_factor(config.rope)


def split_qkv(config: FalconConfig, fused):  # f32[B,T,(N+2K)*hd] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
    """The fused projection's three layouts. Query head j*G+g belongs to KV group j (G = N/K)."""
    B, T, _ = fused.shape
    N, K, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if config.new_decoder_architecture:  # per KV group: G query heads, then its k, then its v
        qkv = fused.view(B, T, K, N // K + 2, hd)
        return qkv[:, :, :, :-2].reshape(B, T, N, hd), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if config.multi_query:  # [Q (all heads); K; V], one K/V head
        qkv = fused.view(B, T, N + 2, hd)
        return qkv[:, :, :N], qkv[:, :, N:N + 1], qkv[:, :, N + 1:]
    qkv = fused.view(B, T, N, 3, hd)  # per head [q, k, v]
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def layer_inputs(config: FalconConfig, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope)


# ---- modules --------------------------------------------------------------------------------

FalconLayerNorm = LayerNorm


def FalconMLP(config: FalconConfig) -> PlainMLP:
    return PlainMLP(config.hidden_size, config.intermediate_size, config.activation, config.bias,
                    names=("dense_h_to_4h", "dense_4h_to_h"))


class FalconAttention(nn.Module):
    def __init__(self, config: FalconConfig):
        super().__init__()
        self.config = config
        D, N, K, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.query_key_value = nn.Linear(D, (N + 2 * K) * hd, bias=config.bias)
        self.dense = nn.Linear(N * hd, D, bias=config.bias)

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        return split_qkv(self.config, self.query_key_value(x))

    def forward(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.dense(attend(*self.project_qkv(x), inputs, self.config.head_dim ** -0.5))


class FalconDecoderLayer(nn.Module):
    """Parallel block: x + (mlp(ln_mlp(x)) + attn(ln_attn(x))); with one norm both branches read input_layernorm(x)."""

    def __init__(self, config: FalconConfig):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.two_norms = config.num_parallel_norms == 2
        if self.two_norms:
            self.ln_attn = LayerNorm(D, eps)
            self.ln_mlp = LayerNorm(D, eps)
        else:
            self.input_layernorm = LayerNorm(D, eps)
        self.self_attention = FalconAttention(config)
        self.mlp = FalconMLP(config)

    def forward(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        # HF's order of the sums: mlp_output += attention_output; residual + mlp_output
        return hidden + (self.mlp(mlp_in) + self.self_attention(attn_in, inputs))


class FalconModel(nn.Module):
    def __init__(self, config: FalconConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        inputs = layer_inputs(self.config, attention_mask, position_ids)
        hidden = self.word_embeddings(input_ids)
        for layer in self.h:
            hidden = layer(hidden, inputs)
        return self.ln_f(hidden)


class FalconForCausalLM(nn.Module):
    def __init__(self, config: FalconConfig):
        super().__init__()
        self.config = config
        self.transformer = FalconModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.word_embeddings.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.transformer(input_ids, attention_mask, position_ids)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode."""
        return load_pretrained(cls, FalconConfig.from_pretrained(path), path)
