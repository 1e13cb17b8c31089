"""Phi-4 (HF model_type "phi3") in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_phi3.py is Llama-shaped (pre-norm RMSNorm blocks, RoPE, GQA eager attention, SwiGLU),
so this file reuses models/llama3.py's blocks and keeps only what is Phi's own:
- one fused `qkv_proj` [(N + 2K) * hd, D] whose output rows are [Q | K | V];
- one fused `gate_up_proj` [2I, D] whose first half is the gate: down(up * silu(gate));
- partial rotary: `partial_rotary_factor` rotates the first rotary_dim channels of each head and passes
  the rest through (Phi-4-mini uses 0.75; Phi-4 itself rotates all of head_dim). Only the default RoPE
  is supported here, not Phi-3.5/4-mini's `longrope` scaling;
- an optional sliding window (Phi-3-mini has one; Phi-4's `sliding_window` is null).
The residual and embedding dropouts (`resid_pdrop`, `embd_pdrop`) are identities in eval and omitted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from torch_sources.models import layers
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, attend, causal_mask, eager_attention,
                                         rms_norm, rope_cos_sin)
from torch_sources.models.llama3 import LlamaDecoderLayer, LlamaForCausalLM
from torch_sources.models.loading import load_config, load_pretrained

__all__ = [
    "Phi3Config",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention", "layer_inputs",
    "split_qkv",
    "Phi3RMSNorm", "Phi3MLP", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM",
]


@dataclass(frozen=True)
class Phi3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.rotary_dim % 2 == 0, self.rotary_dim

    @classmethod
    def from_hf(cls, d: dict) -> "Phi3Config":
        d = dict(d)
        if "rope_parameters" in d and "rope_theta" not in d:  # transformers>=5 writes this form
            rope = dict(d["rope_parameters"])
            d["rope_theta"] = rope["rope_theta"]
            d["partial_rotary_factor"] = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            d["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        if d.get("rope_scaling") is not None:
            raise ValueError(f"unsupported rope_scaling {d['rope_scaling']} (only the default RoPE; no longrope)")
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "Phi3Config":
        return cls.from_hf(load_config(path))

    @property
    def head_dim(self) -> int:  # Phi-3/4 configs carry no head_dim key
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:  # HF: int(head_dim * partial_rotary_factor)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps


# ---- operators (the shared layers, at the config's settings) --------------------------------

def rope_inv_freq(config: Phi3Config):  # -> f32[rotary_dim/2]
    return layers.rope_inv_freq(config.rotary_dim, config.rope_theta)


def layer_inputs(config: Phi3Config, attention_mask, position_ids=None) -> LayerInputs:
    return layers.layer_inputs(attention_mask, position_ids, inv_freq=rope_inv_freq(config),
                               sliding_window=config.sliding_window)


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

