"""Mistral (7B v0.2+ style) in Flax Linen: the torch-free twin of torch_sources/models/mistral.py.

Llama's blocks (jax_oracles/models/llama3.py) under a sliding-window mask: a query at t attends key s
iff s <= t and t - s < sliding_window. Same public names in the same order; params named after the
HF checkpoint (see conversion/mistral.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from jax_oracles.models import layers, llama3
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, KeyAudit
from jax_oracles.models.layers import LayerInputs, RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm, rope_cos_sin
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

AUTO_MODEL = ("mistral", "MistralForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "MistralConfig",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "MistralRMSNorm", "MistralMLP", "MistralAttention", "MistralDecoderLayer", "MistralForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "mistral",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                       "tie_word_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT},
    refused={"hidden_act": (("silu",), "SwiGLU is Mistral's MLP")})


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
    rope: Rope
    max_position_embeddings: int
    sliding_window: int | None = None  # v0.1: 4096; v0.2+ releases: null (full attention)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "MistralConfig":
        """Either config.json form (the release's `rope_theta`, transformers 5's `rope_parameters`); every key
        accounted for (CONFIG_KEYS), the RoPE read by models/rope.py."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the release omits it; transformers 5 may write null
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["rope"] = read_rope(d, d["head_dim"], what="mistral config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "MistralConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def attention_bias(self) -> bool:  # read by the Llama blocks; Mistral's projections have no bias
        return False

    @property
    def mlp_bias(self) -> bool:
        return False


# ---- operators (the Llama ones, and the window in the mask) ---------------------------------

rope_inv_freq, rope_attention_factor = llama3.rope_inv_freq, llama3.rope_attention_factor


def layer_inputs(config: MistralConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Every layer shares one mask: causal, key padding and the sliding window."""
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope, sliding_window=config.sliding_window)


# ---- modules: Llama's, unchanged (the window lives in the mask) -----------------------------

MistralRMSNorm = RMSNorm
MistralMLP = LlamaMLP
MistralAttention = LlamaAttention
MistralDecoderLayer = LlamaDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: MistralConfig
    lora_scaling: float = 2.0
    decoder_layer: type = MistralDecoderLayer
    layer_inputs_fn: object = layer_inputs
