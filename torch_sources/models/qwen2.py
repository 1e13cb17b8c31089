"""Qwen2 / Qwen2.5 in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_qwen2.py is Llama with biased q/k/v projections (o_proj stays unbiased):
this file composes the Llama blocks (models/llama3.py) and keeps only what is Qwen2's own: its config
keys (RMSNorm eps 1e-6, plain RoPE at rope_theta 1e6, tied embeddings on 0.5B/1.5B) and that bias
pattern. The release keeps `sliding_window` / `max_window_layers` with `use_sliding_window: false`;
only that full-attention setting is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from torch_sources.models import layers
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm,
                                         rope_cos_sin)
from torch_sources.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch_sources.models.loading import load_config, load_pretrained

__all__ = [
    "Qwen2Config",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention", "Qwen2DecoderLayer", "Qwen2ForCausalLM",
]


@dataclass(frozen=True)
class Qwen2Config:
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
    use_sliding_window: bool = False
    sliding_window: int | None = None  # the release's value is dropped while use_sliding_window is false
    max_window_layers: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert not self.use_sliding_window, "Qwen2 sliding-window layers are not supported (no release uses them)"

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2Config":
        """Either config.json form: the release's (`rope_theta`) or transformers>=5's (`rope_parameters`)."""
        d = dict(d)
        if d.get("head_dim") is None:  # the release omits it
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if not d.get("use_sliding_window", False):
            d["sliding_window"] = None  # as transformers reads it: no window while use_sliding_window is off
        rope = d.pop("rope_parameters", None) or {}
        assert rope.get("rope_type", "default") == "default", f"unsupported rope {rope}"
        d.setdefault("rope_theta", rope.get("rope_theta"))
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Qwen2Config":
        return cls.from_hf(load_config(path))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def attention_bias(self) -> bool:  # read by the Llama attention: q/k/v biased (Qwen2Attention unbiases o_proj)
        return True

    @property
    def mlp_bias(self) -> bool:
        return False


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Qwen2Config):  # -> f32[hd/2]
    return layers.rope_inv_freq(config.head_dim, config.rope_theta)


def layer_inputs(config: Qwen2Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config))


# ---- modules --------------------------------------------------------------------------------

Qwen2RMSNorm = RMSNorm
Qwen2MLP = LlamaMLP


class Qwen2Attention(LlamaAttention):
    """Llama's attention with q/k/v biases; o_proj has none (hard-coded in modeling_qwen2.py)."""

    def __init__(self, config: Qwen2Config):
        super().__init__(config)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Qwen2Config):
        super().__init__(config, attention=Qwen2Attention)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Qwen2Config):
        super().__init__(config, Qwen2DecoderLayer, layer_inputs)

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode.
        The tied release stores no lm_head: the head is the embedding."""
        return load_pretrained(cls, Qwen2Config.from_pretrained(path), path)
