"""StarCoder2 in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_starcoder2.py composed from the shared layers (models/layers.py). What is
StarCoder2's own, against Llama: biased LayerNorms (`norm_epsilon`), biases on q/k/v/o and on the
plain MLP `c_fc` -> gelu_pytorch_tanh -> `c_proj` (`use_bias`), a sliding window on every layer
(a key is seen iff q - k < sliding_window), and an output head tied to the embedding (the config
default; starcoder2-3b stores no lm_head). The embedding, attention and residual dropouts are
identities in eval and omitted. Submodule names equal the HF state-dict keys.
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
        return cls.from_hf(load_config(path))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.norm_epsilon


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Starcoder2Config) -> torch.Tensor:  # -> f32[hd/2]: the table at init (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: Starcoder2Config) -> float:
    return rope.attention_factor(config.rope)


def layer_inputs(config: Starcoder2Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope, sliding_window=config.sliding_window)


# ---- modules --------------------------------------------------------------------------------

def Starcoder2MLP(config: Starcoder2Config) -> PlainMLP:
    return PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.use_bias,
                    names=("c_fc", "c_proj"))


class Starcoder2Attention(nn.Module):
    def __init__(self, config: Starcoder2Config):
        super().__init__()
        D, hd, bias = config.hidden_size, config.head_dim, config.use_bias
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


class Starcoder2DecoderLayer(nn.Module):
    """Pre-norm block with biased LayerNorms: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: Starcoder2Config):
        super().__init__()
        self.self_attn = Starcoder2Attention(config)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon)

    def forward(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Starcoder2Model(nn.Module):
    def __init__(self, config: Starcoder2Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Starcoder2DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.norm_epsilon)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        inputs = layer_inputs(self.config, attention_mask, position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, inputs)
        return self.norm(hidden)


class Starcoder2ForCausalLM(nn.Module):
    def __init__(self, config: Starcoder2Config):
        super().__init__()
        self.config = config
        self.model = Starcoder2Model(config)
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
        return load_pretrained(cls, Starcoder2Config.from_pretrained(path), path)
