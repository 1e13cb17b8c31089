"""Llama 3 / 3.1 in pure PyTorch, eager fp32: the reference the JAX twin is held against.

Numerics follow transformers' modeling_llama.py: RMSNorm in fp32 cast back before the weight,
llama3-scaled RoPE computed in fp32 (modeling_rope_utils `_compute_llama3_parameters`),
rotate-half RoPE, GQA by repeating KV heads, eager attention with an fp32 softmax, SwiGLU.
Submodule names equal the HF state-dict keys, so a checkpoint loads with load_state_dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models.loading import load_config, load_state_dict

__all__ = [
    "RopeScaling", "LlamaConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM",
]


@dataclass(frozen=True)
class RopeScaling:
    """config.json `rope_scaling` of Llama 3.1 (rope_type "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        assert self.hidden_act == "silu", self.hidden_act
        assert self.num_attention_heads % self.num_key_value_heads == 0

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])  # 3.1 configs omit it
        if "rope_parameters" in d and "rope_theta" not in d:  # transformers>=5 writes this form
            rope = dict(d["rope_parameters"])
            d["rope_theta"] = rope.pop("rope_theta")
            d["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        scaling = d.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "llama3"))
            assert scaling["rope_type"] == "llama3", f"unsupported rope_type {scaling['rope_type']}"
            d["rope_scaling"] = RopeScaling(**{f.name: scaling[f.name] for f in fields(RopeScaling)})
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "LlamaConfig":
        return cls.from_hf(load_config(path))


# ---- operators ------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)  # HF casts back before the weight multiply


def rope_inv_freq(config: LlamaConfig):  # -> f32[hd/2]
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / s.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(inv_freq, position_ids):  # f32[hd/2], i32[B,T] -> (cos, sin) f32[B,T,hd]
    freqs = position_ids[..., None].float() * inv_freq.float()  # f32[B,T,hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):  # x: f32[B,T,N,hd]  cos, sin: f32[B,T,hd]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + _rotate_half(x) * sin


def causal_mask(attention_mask):  # i32[B,T] -> bool[B,T,T]; True = query t may attend key s
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None] & attention_mask.bool()[:, None, :]


def eager_attention(q, k, v, mask, scale: float):
    """q: f32[B,T,N,hd]  k, v: f32[B,S,K,hd]  mask: bool[B,T,S] -> f32[B,T,N,hd].

    KV head j serves query heads j*G .. j*G+G-1 (HF repeat_kv); softmax in fp32.
    """
    groups = q.shape[2] // k.shape[2]
    q = q.transpose(1, 2)  # [B,N,T,hd]
    k = k.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B,N,S,hd]
    v = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B,N,T,S]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)  # [B,T,N,hd]


# ---- modules --------------------------------------------------------------------------------

class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        D, I, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(D, I, bias=bias)
        self.up_proj = nn.Linear(D, I, bias=bias)
        self.down_proj = nn.Linear(I, D, bias=bias)

    def forward(self, x):  # f32[B,T,D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        D, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=bias)

    def forward(self, x, mask, cos, sin):  # x: f32[B,T,D]  mask: bool[B,T,T]  cos, sin: f32[B,T,hd]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = eager_attention(q, k, v, mask, self.head_dim ** -0.5)  # [B,T,N,hd]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, mask, cos, sin):  # f32[B,T,D] -> f32[B,T,D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), mask, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        B, T = input_ids.shape
        if position_ids is None:  # right padding; left-padded generation passes HF's mask cumsum - 1
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        # Recomputed per call (hd/2 floats) rather than stored, so a meta-device build stays valid.
        cos, sin = rope_cos_sin(rope_inv_freq(self.config).to(input_ids.device), position_ids)
        mask = causal_mask(attention_mask)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, mask, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path) -> "LlamaForCausalLM":
        """Build from an HF checkpoint directory (single file or sharded index), in fp32, eval mode."""
        config = LlamaConfig.from_pretrained(path)
        state = {k: v.to(torch.float32) for k, v in load_state_dict(path).items()}
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()
