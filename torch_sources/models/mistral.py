"""Mistral (7B v0.2+ style) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_mistral.py is Llama with a sliding-window mask: this file composes the Llama
blocks (models/llama3.py) and keeps only what is Mistral's own: its config keys (no attention_bias /
mlp_bias / head_dim in the release's config.json, plain RoPE at rope_theta 1e6) and the mask, where a
query at t attends key s iff s <= t and t - s < sliding_window (masking_utils'
`sliding_window_overlay`: kv_idx > q_idx - sliding_window). The window counts array positions, not
position ids, so left padding does not move it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch_sources.models import layers
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm,
                                         rope_cos_sin)
from torch_sources.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch_sources.models.loading import load_config, load_pretrained

__all__ = [
    "MistralConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "MistralRMSNorm", "MistralMLP", "MistralAttention", "MistralDecoderLayer", "MistralForCausalLM",
]


@dataclass(frozen=True)
class MistralConfig:
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
    sliding_window: int | None = None  # v0.1: 4096; v0.2+ releases: null (full attention)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "MistralConfig":
        """Either config.json form: the release's (`rope_theta`) or transformers>=5's (`rope_parameters`)."""
        d = dict(d)
        if d.get("head_dim") is None:  # the release omits it; transformers 5 may write null
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        rope = d.pop("rope_parameters", None) or {}
        assert rope.get("rope_type", "default") == "default", f"unsupported rope {rope}"
        d.setdefault("rope_theta", rope.get("rope_theta"))
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "MistralConfig":
        return cls.from_hf(load_config(path))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def attention_bias(self) -> bool:  # read by the Llama blocks; Mistral's projections have no bias
        return False

    @property
    def mlp_bias(self) -> bool:
        return False


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: MistralConfig):  # -> f32[hd/2]
    return layers.rope_inv_freq(config.head_dim, config.rope_theta)


def layer_inputs(config: MistralConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Every layer shares one mask: causal, key padding and the sliding window."""
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config),
                               sliding_window=config.sliding_window)


# ---- modules: Llama's, unchanged (the window lives in the mask) -----------------------------

MistralRMSNorm = RMSNorm
MistralMLP = LlamaMLP
MistralAttention = LlamaAttention
MistralDecoderLayer = LlamaDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: MistralConfig):
        super().__init__(config, MistralDecoderLayer, layer_inputs)

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode."""
        return load_pretrained(cls, MistralConfig.from_pretrained(path), path)
