"""Qwen3 (dense) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_qwen3.py is Llama plus a per-head RMSNorm on queries and keys (`q_norm`,
`k_norm`, weight [head_dim]) applied after the projection and BEFORE RoPE, with an explicit head_dim
that need not be hidden_size / num_attention_heads (0.6B: 1024 hidden, 16 heads of 128). This file
composes the Llama blocks (models/llama3.py) and keeps only that and Qwen3's config keys (no biases,
RMSNorm eps 1e-6, plain RoPE at rope_theta 1e6, tied embeddings on 0.6B-4B). Like Qwen2, only
`use_sliding_window: false` (every release) is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch_sources.models import layers
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm,
                                         rope_cos_sin)
from torch_sources.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch_sources.models.loading import load_config, load_pretrained

__all__ = [
    "Qwen3Config",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM",
]


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None  # the release's value is dropped while use_sliding_window is false
    max_window_layers: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert not self.use_sliding_window, "Qwen3 sliding-window layers are not supported (no release uses them)"

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        """Either config.json form: the release's (`rope_theta`, `rope_scaling: null`) or transformers>=5's
        (`rope_parameters`)."""
        d = dict(d)
        assert d.pop("rope_scaling", None) is None, "Qwen3 rope scaling (YaRN) is not supported"
        if not d.get("use_sliding_window", False):
            d["sliding_window"] = None  # as transformers reads it: no window while use_sliding_window is off
        rope = d.pop("rope_parameters", None) or {}
        assert rope.get("rope_type", "default") == "default", f"unsupported rope {rope}"
        d.setdefault("rope_theta", rope.get("rope_theta"))
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Qwen3Config":
        return cls.from_hf(load_config(path))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def mlp_bias(self) -> bool:  # read by the Llama MLP
        return False


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Qwen3Config):  # -> f32[hd/2]
    return layers.rope_inv_freq(config.head_dim, config.rope_theta)


def layer_inputs(config: Qwen3Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config))


# ---- modules --------------------------------------------------------------------------------

Qwen3RMSNorm = RMSNorm
Qwen3MLP = LlamaMLP


class Qwen3Attention(LlamaAttention):
    """Llama's attention with q_norm / k_norm: one RMSNorm over head_dim, shared by every head."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        q, k, v = super().project_qkv(x)
        return self.q_norm(q), self.k_norm(k), v  # per head, before `attend` rotates q and k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Qwen3Config):
        super().__init__(config, attention=Qwen3Attention)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Qwen3Config):
        super().__init__(config, Qwen3DecoderLayer, layer_inputs)

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode.
        The tied release stores no lm_head: the head is the embedding."""
        return load_pretrained(cls, Qwen3Config.from_pretrained(path), path)
