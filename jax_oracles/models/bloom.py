"""BLOOM in Flax Linen: the torch-free twin of torch_sources/models/bloom.py.

Composed from the shared layers (jax_oracles/models/layers.py). Same public names in the same order.
Params are named after the HF checkpoint (`params["transformer"]["h_0"]["self_attention"]
["query_key_value"]["kernel"]` = HF weight transposed); see conversion/bloom.py. BLOOM's own: the
embedding LayerNorm, ALiBi from the mask cumsum (position_ids ignored), the per-head-interleaved fused
qkv, biased LayerNorms and projections, a tied head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import (LayerInputs, LayerNorm, PlainMLP, alibi_bias, alibi_slopes, attend,
                                       causal_mask, eager_attention, layer_norm)
from jax_oracles.training.lora import LoraLinear

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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

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
    fused = fused.reshape(B, T, config.n_head, 3, config.head_dim)
    return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]


def layer_inputs(config: BloomConfig, attention_mask, position_ids=None) -> LayerInputs:
    """The causal & padding mask and the ALiBi bias. position_ids are not used: the bias counts each
    key's position over the real keys (mask cumsum - 1), so left padding needs no positions."""
    alibi = alibi_bias(alibi_slopes(config.n_head), attention_mask)
    return LayerInputs(causal_mask(attention_mask), alibi=alibi)


# ---- modules --------------------------------------------------------------------------------

BloomLayerNorm = LayerNorm


def BloomMLP(config: BloomConfig, lora_scaling: float = 2.0, name: str | None = None) -> PlainMLP:
    # HF's bloom_gelu_forward is the tanh approximation (0.79788456 ~ sqrt(2/pi)).
    return PlainMLP(config.hidden_size, config.intermediate_size, "gelu_pytorch_tanh", use_bias=True,
                    names=("dense_h_to_4h", "dense_4h_to_h"), lora_scaling=lora_scaling, name=name)


class BloomAttention(nn.Module):
    config: BloomConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        c = self.config
        fused = LoraLinear(3 * c.hidden_size, use_bias=True, scaling=self.lora_scaling, name="query_key_value")(x)
        # HF: baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(hd)) = alibi + scaled scores, as `attend` adds it.
        out = attend(*split_qkv(c, fused), inputs, c.head_dim ** -0.5)
        return LoraLinear(c.hidden_size, use_bias=True, scaling=self.lora_scaling, name="dense")(out)


class BloomDecoderLayer(nn.Module):
    """Pre-norm block; the residual is the block input (or the normed input, if
    apply_residual_connection_post_layernorm)."""
    config: BloomConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        c = self.config
        post_ln_residual = c.apply_residual_connection_post_layernorm
        normed = LayerNorm(c.layer_norm_epsilon, name="input_layernorm")(hidden)
        attn = BloomAttention(c, self.lora_scaling, name="self_attention")(normed, inputs)
        hidden = (normed if post_ln_residual else hidden) + attn
        normed = LayerNorm(c.layer_norm_epsilon, name="post_attention_layernorm")(hidden)
        return (normed if post_ln_residual else hidden) + BloomMLP(c, self.lora_scaling, name="mlp")(normed)


class BloomModel(nn.Module):
    config: BloomConfig
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        c = self.config
        inputs = layer_inputs(c, attention_mask, position_ids)
        hidden = nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
        hidden = LayerNorm(c.layer_norm_epsilon, name="word_embeddings_layernorm")(hidden)
        for i in range(c.n_layer):
            hidden = BloomDecoderLayer(c, self.lora_scaling, name=f"h_{i}")(hidden, inputs)
        return LayerNorm(c.layer_norm_epsilon, name="ln_f")(hidden)


class BloomForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: BloomConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = BloomModel(self.config, self.lora_scaling, name="transformer")(input_ids, attention_mask,
                                                                                position_ids)
        logits = hidden @ self.variables["params"]["transformer"]["word_embeddings"]["embedding"].T  # tied head
        return (logits, hidden) if return_hidden else logits
