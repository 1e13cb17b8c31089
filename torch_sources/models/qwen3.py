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

from torch_sources.models import llama3
from torch_sources.models.config_keys import ALL_FULL, DROPOUT, ROPE_KEYS, KeyAudit
from torch_sources.models.layers import RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm, rope_cos_sin
from torch_sources.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.rope import Rope, read_rope

AUTO_MODEL = ("qwen3", "Qwen3ForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "Qwen3Config",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "qwen3",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                       "tie_word_embeddings", "attention_bias"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT,
             "sliding_window": "read only under use_sliding_window, which is refused",
             "max_window_layers": "read only under use_sliding_window, which is refused"},
    refused={"hidden_act": (("silu",), "SwiGLU is Qwen3's MLP"),
             "use_sliding_window": ((False, None), "Qwen3 sliding-window layers (no release turns them on)"),
             "layer_types": ((None, ALL_FULL), "a sliding layer needs use_sliding_window, refused")})


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
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        """Either config.json form (the release's `rope_theta` [+ `rope_scaling`], transformers 5's
        `rope_parameters`); every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the release omits it
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["rope"] = read_rope(d, d["head_dim"], what="qwen3 config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Qwen3Config":
        return cls.from_hf(load_config(path))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def sliding_window(self) -> None:  # read by the Llama mask: no window (use_sliding_window is refused)
        return None

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def mlp_bias(self) -> bool:  # read by the Llama MLP
        return False


# ---- operators (the Llama ones) -------------------------------------------------------------

rope_inv_freq, rope_attention_factor, layer_inputs = llama3.rope_inv_freq, llama3.rope_attention_factor, llama3.layer_inputs


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
