"""Qwen2 / Qwen2.5 in Flax Linen: the torch-free twin of torch_sources/models/qwen2.py.

Llama's blocks (jax_oracles/models/llama3.py) with biased q/k/v projections and an unbiased o_proj.
Same public names in the same order; params named after the HF checkpoint (see conversion/qwen2.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from jax_oracles.models import layers
from jax_oracles.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm,
                                       rope_cos_sin)
from jax_oracles.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from jax_oracles.training.lora import LoraLinear

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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def attention_bias(self) -> bool:  # q/k/v biased (Qwen2Attention leaves o_proj unbiased)
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
    """Llama's attention with q/k/v biases; o_proj has none. (Linen cannot rebind a submodule name,
    so all four projections are declared here rather than o_proj replaced after Llama's setup.)"""

    def setup(self):
        c = self.config
        linear = lambda f, bias, name: LoraLinear(f, use_bias=bias, scaling=self.lora_scaling, name=name)
        hd = c.head_dim
        self.q_proj = linear(c.num_attention_heads * hd, True, "q_proj")
        self.k_proj = linear(c.num_key_value_heads * hd, True, "k_proj")
        self.v_proj = linear(c.num_key_value_heads * hd, True, "v_proj")
        self.o_proj = linear(c.hidden_size, False, "o_proj")


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention: type = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask); tied head."""
    config: Qwen2Config
    lora_scaling: float = 2.0
    decoder_layer: type = Qwen2DecoderLayer
    layer_inputs_fn: object = layer_inputs
