"""BLOOM in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_bloom.py composed from the shared layers (models/layers.py). What is BLOOM's own:
- a LayerNorm right after the embedding (`word_embeddings_layernorm`), biased LayerNorms throughout;
- ALiBi instead of RoPE: slope x the key's position from the mask cumsum, so left padding needs no
  position_ids (they are accepted and ignored);
- one fused `query_key_value` [3h, h] whose rows are interleaved per head: view (..., n_head, 3, hd);
- `dense` output projection, MLP `dense_h_to_4h` -> tanh-GELU -> `dense_4h_to_h`, all biased;
- a tied head, and HF's config names (`n_layer`, `n_head`, `layer_norm_epsilon`).
Submodule names equal the HF state-dict keys (`transformer.h.0.self_attention.query_key_value`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import (LayerInputs, LayerNorm, PlainMLP, alibi_bias, alibi_slopes, attend,
                                         causal_mask, eager_attention, layer_norm)
from torch_sources.models.loading import load_config, load_pretrained

AUTO_MODEL = ("bloom", "BloomForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "BloomConfig",
    "layer_norm", "alibi_slopes", "alibi_bias", "causal_mask", "eager_attention", "split_qkv", "layer_inputs",
    "BloomLayerNorm", "BloomMLP", "BloomAttention", "BloomDecoderLayer", "BloomModel", "BloomForCausalLM",
]


_NOT_READ = "transformers' BLOOM does not read it (a Megatron-DeepSpeed training-time key)"
CONFIG_KEYS = KeyAudit(
    "bloom",
    honored=frozenset({"vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon",
                       "apply_residual_connection_post_layernorm", "pretraining_tp", "slow_but_exact",
                       "num_hidden_layers", "num_attention_heads", "n_embed"}),
    ignored={"attention_dropout": DROPOUT, "hidden_dropout": DROPOUT,
             **{k: _NOT_READ for k in ("attention_softmax_in_fp32", "bias_dropout_fusion", "masked_softmax_fusion",
                                     "offset_alibi", "skip_bias_add", "skip_bias_add_qkv", "n_inner", "unk_token_id")}},
    refused={"tie_word_embeddings": ((True, None), "every BLOOM release ties the head to the embedding; an untied "
                                                  "head is not implemented")})


@dataclass(frozen=True)
class BloomConfig:
    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    pretraining_tp: int = 1
    slow_but_exact: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        assert self.hidden_size % self.n_head == 0, (self.hidden_size, self.n_head)
        # HF's slow_but_exact re-sums the output projections in pretraining_tp slices; no release enables it.
        if self.slow_but_exact and self.pretraining_tp > 1:
            raise ConfigError("bloom config not supported by this source: slow_but_exact with pretraining_tp="
                              f"{self.pretraining_tp} (the sliced re-summation is not implemented)")

    @classmethod
    def from_hf(cls, d: dict) -> "BloomConfig":
        """Every key accounted for (CONFIG_KEYS); transformers' aliases (num_hidden_layers, num_attention_heads,
        the oldest configs' n_embed) read as its attribute_map reads them."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        for alias, name in (("n_embed", "hidden_size"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head")):
            if alias in d:
                d.setdefault(name, d.pop(alias))
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "BloomConfig":
        return cls.from_hf(load_config(path))

    # Family-neutral names the generic checks read.
    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def num_key_value_heads(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def intermediate_size(self) -> int:
        return 4 * self.hidden_size

    @property
    def norm_eps(self) -> float:
        return self.layer_norm_epsilon


# ---- operators (the shared layers, at the config's settings) --------------------------------

def split_qkv(config: BloomConfig, fused):  # f32[B,T,3*N*hd] -> q, k, v f32[B,T,N,hd]
    """The fused projection's features are [q_0 k_0 v_0 q_1 k_1 v_1 ...] per head (HF `_reshape`)."""
    B, T, _ = fused.shape
    fused = fused.view(B, T, config.n_head, 3, config.head_dim)
    return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]


def layer_inputs(config: BloomConfig, attention_mask, position_ids=None) -> LayerInputs:
    """The causal & padding mask and the ALiBi bias. position_ids are not used: the bias counts each
    key's position over the real keys (mask cumsum - 1), so left padding needs no positions."""
    alibi = alibi_bias(alibi_slopes(config.n_head).to(attention_mask.device), attention_mask)
    return LayerInputs(causal_mask(attention_mask), alibi=alibi)


# ---- modules --------------------------------------------------------------------------------

BloomLayerNorm = LayerNorm


def BloomMLP(config: BloomConfig) -> PlainMLP:
    # HF's bloom_gelu_forward is the tanh approximation (0.79788456 ~ sqrt(2/pi)).
    return PlainMLP(config.hidden_size, config.intermediate_size, "gelu_pytorch_tanh", bias=True,
                    names=("dense_h_to_4h", "dense_4h_to_h"))


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.config = config
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        # HF: baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(hd)) = alibi + scaled scores, as `attend` adds it.
        q, k, v = split_qkv(self.config, self.query_key_value(x))
        return self.dense(attend(q, k, v, inputs, self.config.head_dim ** -0.5))


class BloomDecoderLayer(nn.Module):
    """Pre-norm block; the residual is the block input (or the normed input, if
    apply_residual_connection_post_layernorm)."""

    def __init__(self, config: BloomConfig):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.post_ln_residual = config.apply_residual_connection_post_layernorm
        self.input_layernorm = LayerNorm(D, eps)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = LayerNorm(D, eps)
        self.mlp = BloomMLP(config)

    def forward(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        normed = self.input_layernorm(hidden)
        hidden = (normed if self.post_ln_residual else hidden) + self.self_attention(normed, inputs)
        normed = self.post_attention_layernorm(hidden)
        return (normed if self.post_ln_residual else hidden) + self.mlp(normed)


class BloomModel(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.h = nn.ModuleList(BloomDecoderLayer(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        inputs = layer_inputs(self.config, attention_mask, position_ids)
        hidden = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for layer in self.h:
            hidden = layer(hidden, inputs)
        return self.ln_f(hidden)


class BloomForCausalLM(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.config = config
        self.transformer = BloomModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight  # tied: the release stores no head

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
        return load_pretrained(cls, BloomConfig.from_pretrained(path), path)
