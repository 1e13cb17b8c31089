"""Qwen2 / Qwen2.5 in Flax Linen: the torch-free twin of torch_sources/models/qwen2.py.

Llama's blocks (jax_oracles/models/llama3.py) with biased q/k/v projections and an unbiased o_proj.
Same public names in the same order; params named after the HF checkpoint (see conversion/qwen2.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from jax_oracles.models import llama3
from jax_oracles.models.config_keys import ALL_FULL, DROPOUT, ROPE_KEYS, KeyAudit
from jax_oracles.models.layers import RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm, rope_cos_sin
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("qwen2", "Qwen2ForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "Qwen2Config",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention", "Qwen2DecoderLayer", "Qwen2ForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "qwen2",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                       "tie_word_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT,
             "sliding_window": "read only under use_sliding_window, which is refused",
             "max_window_layers": "read only under use_sliding_window, which is refused"},
    refused={"hidden_act": (("silu",), "SwiGLU is Qwen2's MLP"),
             "use_sliding_window": ((False, None), "Qwen2 sliding-window layers (no release turns them on)"),
             "layer_types": ((None, ALL_FULL), "a sliding layer needs use_sliding_window, refused"),
             "use_mrope": ((False, None), "multimodal rope sections (Qwen2-VL); the text model has none")})


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
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2Config":
        """Either config.json form (the release's `rope_theta` [+ `rope_scaling`], transformers 5's
        `rope_parameters`); every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the release omits it
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["rope"] = read_rope(d, d["head_dim"], what="qwen2 config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Qwen2Config":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

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
    def attention_bias(self) -> bool:  # read by the Llama attention: q/k/v biased (Qwen2Attention unbiases o_proj)
        return True

    @property
    def mlp_bias(self) -> bool:
        return False


# ---- operators (the Llama ones) -------------------------------------------------------------

rope_inv_freq, rope_attention_factor, layer_inputs = llama3.rope_inv_freq, llama3.rope_attention_factor, llama3.layer_inputs


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
