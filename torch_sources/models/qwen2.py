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

from torch_sources.models import llama3
from torch_sources.models.config_keys import ALL_FULL, DROPOUT, ROPE_KEYS, KeyAudit
from torch_sources.models.layers import RMSNorm, apply_rope, causal_mask, eager_attention, rms_norm, rope_cos_sin
from torch_sources.models.llama3 import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.rope import Rope, read_rope

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
