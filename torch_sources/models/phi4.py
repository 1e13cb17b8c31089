"""Phi-4 (HF model_type "phi3") in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_phi3.py is Llama-shaped (pre-norm RMSNorm blocks, RoPE, GQA eager attention, SwiGLU),
so this file reuses models/llama3.py's blocks and keeps only what is Phi's own:
- one fused `qkv_proj` [(N + 2K) * hd, D] whose output rows are [Q | K | V];
- one fused `gate_up_proj` [2I, D] whose first half is the gate: down(up * silu(gate));
- partial rotary: `partial_rotary_factor` rotates the first rotary_dim channels of each head and passes
  the rest through (Phi-4-mini uses 0.75; Phi-4 itself rotates all of head_dim), with any rope type of
  models/rope.py: Phi-4's plain RoPE, Phi-3.5/4-mini's `longrope` (short factors up to
  original_max_position_embeddings, long ones past it, and its attention factor);
- an optional sliding window (Phi-3-mini has one; Phi-4's `sliding_window` is null).
The residual and embedding dropouts (`resid_pdrop`, `embd_pdrop`) are identities in eval and omitted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from torch_sources.models import layers, llama3
from torch_sources.models.config_keys import DROPOUT, ROPE_KEYS, KeyAudit
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, attend, causal_mask, eager_attention,
                                         rms_norm, rope_cos_sin)
from torch_sources.models.llama3 import LlamaDecoderLayer, LlamaForCausalLM
from torch_sources.models.loading import load_config, load_pretrained
from torch_sources.models.rope import Rope, read_rope

AUTO_MODEL = ("phi3", "Phi3ForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "Phi3Config",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "split_qkv",
    "Phi3RMSNorm", "Phi3MLP", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "phi3",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                       "tie_word_embeddings", "partial_rotary_factor", "original_max_position_embeddings"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT, "resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT},
    refused={"hidden_act": (("silu",), "SwiGLU is Phi-3's MLP"),
             "attention_bias": ((False, None), "transformers' Phi-3 has no projection biases (it does not read the key; "
                                               "Phi-4's release writes false)")})
# Phi3Config's own default: transformers takes longrope's original length from this attribute, not the dict.
ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096


@dataclass(frozen=True)
class Phi3Config:
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
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.rotary_dim % 2 == 0, self.rotary_dim

    @classmethod
    def from_hf(cls, d: dict) -> "Phi3Config":
        """Either config.json form; every key accounted for (CONFIG_KEYS), the RoPE read by models/rope.py:
        Phi-4's plain RoPE, Phi-4-mini's longrope with partial rotary 0.75 (the legacy types `su` and `yarn`
        are longrope, as transformers' Phi3Config reads them)."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:  # the releases carry none; transformers: getattr(config, "head_dim")
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("original_max_position_embeddings", ORIGINAL_MAX_POSITION_EMBEDDINGS)
        d["rope"] = read_rope(d, d["head_dim"], partial_rotary=True, aliases={"su": "longrope", "yarn": "longrope"},
                              top_level_original=True, what="phi3 config")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Phi3Config":
        return cls.from_hf(load_config(path))

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def partial_rotary_factor(self) -> float:
        return self.rope.partial_rotary_factor

    @property
    def rotary_dim(self) -> int:  # HF: int(head_dim * partial_rotary_factor)
        return self.rope.dim

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps


# ---- operators (the shared layers, at the config's settings) --------------------------------

rope_inv_freq, rope_attention_factor = llama3.rope_inv_freq, llama3.rope_attention_factor


def layer_inputs(config: Phi3Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, rope=config.rope, sliding_window=config.sliding_window)


def split_qkv(config: Phi3Config, fused):  # f32[B,T,(N+2K)*hd] -> q [B,T,N,hd], k, v [B,T,K,hd]
    """The fused projection's output rows are [Q | K | V], each head's channels contiguous."""
    N, K, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B, T, _ = fused.shape
    q, k, v = fused.split((N * hd, K * hd, K * hd), dim=-1)
    return q.view(B, T, N, hd), k.view(B, T, K, hd), v.view(B, T, K, hd)


# ---- modules --------------------------------------------------------------------------------

Phi3RMSNorm = RMSNorm


class Phi3MLP(nn.Module):
    """down(up * silu(gate)) with gate and up from one fused projection: rows [gate | up]."""

    def __init__(self, config: Phi3Config):
        super().__init__()
        D, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(D, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)
        self.act = layers.ACTIVATIONS[config.hidden_act]

    def forward(self, x):  # f32[B,T,D] -> f32[B,T,D]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Phi3Attention(nn.Module):
    def __init__(self, config: Phi3Config):
        super().__init__()
        self.config = config
        N, K, hd, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.qkv_proj = nn.Linear(D, (N + 2 * K) * hd, bias=False)
        self.o_proj = nn.Linear(N * hd, D, bias=False)

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd]
        return split_qkv(self.config, self.qkv_proj(x))

    def forward(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        return self.o_proj(attend(*self.project_qkv(x), inputs, self.config.head_dim ** -0.5))


def Phi3DecoderLayer(config: Phi3Config) -> LlamaDecoderLayer:
    """Llama's pre-norm block with Phi's fused attention and MLP."""
    return LlamaDecoderLayer(config, attention=Phi3Attention, feed_forward=Phi3MLP)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's causal LM (embed_tokens, layers, norm, untied lm_head as Phi-4) over Phi3DecoderLayer."""

    def __init__(self, config: Phi3Config):
        super().__init__(config, decoder_layer=Phi3DecoderLayer, layer_inputs_fn=layer_inputs)

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode."""
        return load_pretrained(cls, Phi3Config.from_pretrained(path), path)

