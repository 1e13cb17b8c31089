"""GPT-OSS (openai/gpt-oss-20b / 120b) in pure PyTorch, eager fp32: the reference the JAX twin is held against.

transformers' modeling_gpt_oss.py composed from the shared layers (models/layers.py). What is GPT-OSS's own:
- layers alternate sliding / full attention (`layer_types`; a sliding layer's query at t sees keys s with
  t - s < sliding_window), every projection biased, and a learned per-head attention sink, one extra logit
  in the softmax's normaliser (layers.eager_attention's `sinks`);
- YaRN RoPE (rotate-half; models/rope.py), whose cos and sin carry the attention factor (0.1 ln(factor) + 1,
  or the mscale / mscale_all_dim ratio where a config sets both);
- a mixture-of-experts MLP: the router takes the top-k logits and softmaxes over those k; each expert is a
  clamped SwiGLU on an INTERLEAVED gate_up (gate = even columns, up = odd), `(up + 1) * gate * sigmoid(1.702
  gate)`, with gate <= limit and |up| <= limit; the outputs are weighted by the routing weights and summed;
- the release stores the experts MXFP4 (models/mxfp4.py): from_pretrained dequantizes them to HF's fp32
  layout (gate_up_proj [E,H,2I], down_proj [E,I,H], i.e. x @ W), the names of the parameters here.
Submodule names equal the HF state-dict keys (after dequantization).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models import rope
from torch_sources.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from torch_sources.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, default_positions,
                                         eager_attention, rms_norm, rope_cos_sin)
from torch_sources.models.loading import load_config, load_state_dict
from torch_sources.models.rope import Rope, read_rope
from torch_sources.models.mxfp4 import dequantize_mxfp4

AUTO_MODEL = ("gpt_oss", "GptOssForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "GptOssConfig",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask",
    "eager_attention", "layer_inputs", "route", "swiglu_clamped",
    "GptOssRMSNorm", "GptOssAttention", "GptOssTopKRouter", "GptOssExperts", "GptOssMLP", "GptOssDecoderLayer",
    "GptOssModel", "GptOssForCausalLM",
]


CONFIG_KEYS = KeyAudit(
    "gpt_oss",
    honored=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                       "layer_types", "num_local_experts", "num_experts", "num_experts_per_tok", "swiglu_limit",
                       "swiglu_alpha", "attention_bias", "tie_word_embeddings", "experts_per_token"}) | ROPE_KEYS,
    ignored={"attention_dropout": DROPOUT,
             "hidden_act": "transformers' GPT-OSS does not read it (its experts' clamped SwiGLU is fixed)",
             "initial_context_length": "transformers does not read it (the release's YaRN block carries the length)",
             "quantization_config": "the stored format of the experts (mxfp4 blocks and scales); the loader "
                                    "dequantizes by tensor name (models/mxfp4.py)",
             "router_aux_loss_coef": "read only under output_router_logits, which is refused"},
    refused={"output_router_logits": ((False, None), "the router's auxiliary loss in the training loss is not "
                                                      "implemented")})


@dataclass(frozen=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...]
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702  # not in the release's config.json: transformers' constant
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert len(self.layer_types) == self.num_hidden_layers, self.layer_types
        if set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise ConfigError(f"gpt_oss config: layer_types={list(self.layer_types)}")

    @classmethod
    def from_hf(cls, d: dict) -> "GptOssConfig":
        """Either config.json form: the release's (`rope_theta` + `rope_scaling`) or transformers 5's
        (`rope_parameters`, theta inside); every key accounted for (CONFIG_KEYS). With no RoPE block,
        transformers' default (YaRN factor 32 over 4096, truncate false). The router's top-k is
        `num_experts_per_tok` (default 4): transformers does not read the release's `experts_per_token`,
        so a config where the two differ is refused."""
        CONFIG_KEYS.check(d)
        d = dict(d)
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if not (d.get("rope_scaling") or d.get("rope_parameters")):
            d["rope_parameters"] = dict(DEFAULT_ROPE)
        d["rope"] = read_rope(d, d["head_dim"], default_theta=150_000.0, what="gpt_oss config")
        if d.get("layer_types") is None:  # transformers' default: even layers slide
            d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(d["num_hidden_layers"])]
        d["layer_types"] = tuple(d["layer_types"])
        if "num_experts" in d:  # transformers' attribute_map alias
            d.setdefault("num_local_experts", d.pop("num_experts"))
        d.setdefault("num_experts_per_tok", 4)
        if d.get("experts_per_token") not in (None, d["num_experts_per_tok"]):
            raise ConfigError(f"gpt_oss config: experts_per_token={d['experts_per_token']} differs from "
                              f"num_experts_per_tok={d['num_experts_per_tok']} (transformers routes to the latter and "
                              f"does not read the former); refusing to guess the router's top-k")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_pretrained(cls, path) -> "GptOssConfig":
        return cls.from_hf(load_config(path))

    @property
    def norm_eps(self) -> float:  # the family-neutral name the generic checks read
        return self.rms_norm_eps

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def layer_sliding_window(self, i: int) -> int | None:
        """Layer i's window (keys with t - s < window), None on a full-attention layer."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


# ---- operators (the shared layers, at the config's settings; and GPT-OSS's own) -------------

# transformers' GptOssConfig default when a config carries no RoPE block
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def rope_inv_freq(config: GptOssConfig) -> torch.Tensor:  # -> f32[hd/2] (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: GptOssConfig) -> float:
    """YaRN's cos/sin multiplier: the config's attention_factor, else from mscale / mscale_all_dim, else
    0.1 ln(factor) + 1 (1.3466 at 32)."""
    return rope.attention_factor(config.rope)


def layer_inputs(config: GptOssConfig, attention_mask, position_ids=None) -> LayerInputs:
    """The full-attention mask (causal & key padding) and the scaled YaRN cos/sin. Sliding layers narrow
    the mask to their window themselves (GptOssAttention.mask)."""
    if position_ids is None:
        position_ids = default_positions(attention_mask)
    cos, sin = rope.cos_sin(config.rope, position_ids.to(attention_mask.device))
    return LayerInputs(causal_mask(attention_mask), cos, sin)


def route(router_logits, top_k: int):  # f32[T,E] -> (weights f32[T,k], indices i64[T,k])
    """Top-k logits, softmaxed over those k: transformers' GptOssTopKRouter, with one rule made explicit.
    transformers takes torch.topk, whose order on exact ties PyTorch leaves unspecified (CPU, 4 experts:
    [0, 0, 0, 0], k=2 -> experts 2, 3; 128 equal logits -> 86, 85, 84, 87). Here a stable descending sort
    decides: on an exact tie the lower expert index wins, jax.lax.top_k's documented rule, so both twins
    route identically. Off exact ties across the k-th place the experts, the weights and (the experts sum in
    ascending expert order) the output equal transformers'."""
    values, indices = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    values, indices = values[..., :top_k], indices[..., :top_k]
    return F.softmax(values, dim=-1, dtype=values.dtype), indices


def swiglu_clamped(gate_up, alpha: float, limit: float):  # f32[...,2I] interleaved -> f32[...,I]
    """GPT-OSS's SwiGLU: gate = even columns clamped above at limit, up = odd columns clamped to +-limit,
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# ---- modules --------------------------------------------------------------------------------

GptOssRMSNorm = RMSNorm


class GptOssAttention(nn.Module):
    def __init__(self, config: GptOssConfig, layer_idx: int = 0):
        super().__init__()
        D, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.scaling = hd ** -0.5
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))  # f32[N]: one sink logit per query head

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd] (before RoPE)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def mask(self, full_mask):  # bool[B,T,T] -> this layer's: the window band on a sliding layer
        if self.sliding_window is None:
            return full_mask
        T = full_mask.shape[-1]
        band = causal_mask(torch.ones(1, T, dtype=torch.int64, device=full_mask.device), self.sliding_window)
        return full_mask & band

    def forward(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        q, k, v = self.project_qkv(x)
        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
        out = eager_attention(q, k, v, self.mask(inputs.mask), self.scaling, sinks=self.sinks)
        B, T, N, hd = out.shape
        return self.o_proj(out.reshape(B, T, N * hd))


class GptOssTopKRouter(nn.Module):
    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_local_experts, config.hidden_size))  # [E,H]
        self.bias = nn.Parameter(torch.zeros(config.num_local_experts))

    def forward(self, x):  # f32[T,H] -> (logits f32[T,E], weights f32[T,k], indices i64[T,k])
        logits = F.linear(x, self.weight, self.bias)
        return (logits, *route(logits, self.top_k))


class GptOssExperts(nn.Module):
    """E clamped-SwiGLU experts, HF's dequantized layout: x @ gate_up_proj[e] (columns interleaved gate/up)."""

    def __init__(self, config: GptOssConfig):
        super().__init__()
        E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts, self.alpha, self.limit = E, config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))

    def expert(self, e: int, x):  # f32[n,H] -> f32[n,H]: expert e alone
        h = swiglu_clamped(x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e], self.alpha, self.limit)
        return h @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x, indices, weights):  # f32[T,H], i64[T,k], f32[T,k] -> f32[T,H]
        out = torch.zeros_like(x)
        for e in indices.unique().tolist():  # only the experts some token picked
            tok, slot = torch.nonzero(indices == e, as_tuple=True)
            out.index_add_(0, tok, self.expert(e, x[tok]) * weights[tok, slot, None])
        return out


class GptOssMLP(nn.Module):
    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.router = GptOssTopKRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, x):  # f32[B,T,D] -> f32[B,T,D]
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.router(flat)
        return self.experts(flat, indices, weights).reshape(x.shape)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x)). Layer layer_idx's type picks the window."""

    def __init__(self, config: GptOssConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GptOssModel(nn.Module):
    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        inputs = layer_inputs(self.config, attention_mask, position_ids)  # per call: a meta build stays valid
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, inputs)
        return self.norm(hidden)


def _dequantized_state(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32, each MXFP4 `<w>_blocks` / `<w>_scales` pair (stored out x in) replaced
    by `<w>` in HF's x @ W layout [E, in, out]. An already dequantized checkpoint passes through."""
    state = load_state_dict(path)
    for name in [n for n in state if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        state[base] = dequantize_mxfp4(state.pop(name), state.pop(base + "_scales")).transpose(-1, -2).contiguous()
    return {k: v.to(torch.float32) for k, v in state.items()}


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.config = config
        self.model = GptOssModel(config)
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
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (MXFP4 experts dequantized by models/mxfp4.py), fp32, eval."""
        config = GptOssConfig.from_pretrained(path)
        state = _dequantized_state(path)
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()
