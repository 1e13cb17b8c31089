"""GPT-OSS (openai/gpt-oss-20b, -120b) in Flax Linen: the torch-free twin of torch_sources/models/gpt_oss.py.

Same public names in the same order. What is GPT-OSS's own (transformers' modeling_gpt_oss.py):
- attention with biased q/k/v/o, 1/sqrt(head_dim) scale and a learned sink logit per query head that
  joins the softmax normaliser only; layers alternate sliding-window (even i) and full attention;
- RoPE with YaRN scaling: cos and sin are multiplied by the attention factor 0.1 ln(factor) + 1;
- a mixture of experts instead of the MLP: a biased router, top-k then a softmax over the k logits;
  each expert a biased gate_up projection with gate/up *interleaved* (gate = even columns), a clamped
  SwiGLU (`swiglu_clamped`), a biased down projection; outputs weighted and summed.

The experts run as a grouped matmul: the T*k (token, expert) assignments are sorted by expert and
jax.lax.ragged_dot multiplies each contiguous group by its expert's weights (no Python loop over
experts, static shapes under jit); see GptOssExperts.

Params are named after the HF checkpoint (conversion/gpt_oss.py):
`params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]` = HF weight transposed, `self_attn/sinks`
f32[N], `mlp/router/{weight [E,D], bias [E]}` and `mlp/experts/{gate_up_proj [E,D,2I], gate_up_proj_bias,
down_proj [E,I,D], down_proj_bias}` in the HF (dequantized) layout. A model bound to its params exposes
`model.layers[i].self_attn` (`project_qkv`, `sliding_window`, `scaling`, `sinks`), `.mlp`,
`.input_layernorm`, `.post_attention_layernorm`, `model.embed_tokens`, `model.norm` (the serving engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_oracles.models import rope
from jax_oracles.models.config_keys import DROPOUT, ROPE_KEYS, ConfigError, KeyAudit
from jax_oracles.models.layers import (LayerInputs, RMSNorm, apply_rope, causal_mask, default_positions,
                                       eager_attention, rms_norm, rope_cos_sin)
from jax_oracles.models.rope import Rope, read_rope
from jax_oracles.training.lora import LoraLinear

AUTO_MODEL = ("gpt_oss", "GptOssForCausalLM")  # HF model_type -> this file's causal LM (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "GptOssConfig",
    "rms_norm", "rope_inv_freq", "rope_attention_factor", "rope_cos_sin", "apply_rope", "causal_mask",
    "eager_attention", "layer_inputs", "route", "swiglu_clamped",
    "GptOssRMSNorm", "GptOssAttention", "GptOssTopKRouter", "GptOssExperts", "GptOssMLP", "GptOssDecoderLayer",
    "GptOssModel", "GptOssForCausalLM",
]

HIGHEST = jax.lax.Precision.HIGHEST


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
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

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


def rope_inv_freq(config: GptOssConfig):  # -> f32[hd/2] (models/rope.py)
    return rope.inv_freq(config.rope)


def rope_attention_factor(config: GptOssConfig) -> float:
    """YaRN's cos/sin multiplier: the config's attention_factor, else from mscale / mscale_all_dim, else
    0.1 ln(factor) + 1 (1.3466 at 32)."""
    return rope.attention_factor(config.rope)


def layer_inputs(config: GptOssConfig, attention_mask, position_ids=None) -> LayerInputs:
    """The full-attention mask (causal & key padding) and the scaled YaRN cos/sin every layer shares;
    sliding layers narrow the mask to their window themselves (GptOssAttention.mask)."""
    if position_ids is None:
        position_ids = default_positions(attention_mask)
    cos, sin = rope.cos_sin(config.rope, position_ids)
    return LayerInputs(causal_mask(attention_mask), cos, sin)


def route(router_logits, top_k: int):  # f32[T,E] -> (weights f32[T,k], indices i32[T,k])
    """The top_k experts of each token and a softmax over their k logits (= the full softmax
    renormalised over the top k). jax.lax.top_k returns values in descending order and, on exactly
    equal logits, the lower expert index first: the torch source's rule (a stable sort there; transformers'
    torch.topk leaves tie order unspecified)."""
    values, indices = jax.lax.top_k(router_logits, top_k)
    return jax.nn.softmax(values, axis=-1), indices


def swiglu_clamped(gate_up, alpha: float, limit: float):  # f32[..., 2I] (interleaved) -> f32[..., I]
    """GPT-OSS's SwiGLU: gate = even columns clamped above at `limit`, up = odd columns clamped to
    [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


# ---- modules --------------------------------------------------------------------------------

# GPT-OSS's RMSNorm multiplies the weight in fp32 before casting back, Llama's after: equal in fp32.
GptOssRMSNorm = RMSNorm


class GptOssAttention(nn.Module):
    config: GptOssConfig
    layer_idx: int = 0
    lora_scaling: float = 2.0

    @property
    def sliding_window(self) -> int | None:  # keys t - s < window (self included); None on full layers
        return self.config.layer_sliding_window(self.layer_idx)

    @property
    def scaling(self) -> float:
        return self.config.head_dim ** -0.5

    def setup(self):
        c = self.config
        def linear(features, name):
            return LoraLinear(features, use_bias=c.attention_bias, scaling=self.lora_scaling, name=name)

        hd = c.head_dim
        self.q_proj = linear(c.num_attention_heads * hd, "q_proj")
        self.k_proj = linear(c.num_key_value_heads * hd, "k_proj")
        self.v_proj = linear(c.num_key_value_heads * hd, "v_proj")
        self.o_proj = linear(c.hidden_size, "o_proj")
        self.sinks = self.param("sinks", nn.initializers.zeros_init(), (c.num_attention_heads,), jnp.float32)

    def project_qkv(self, x):  # f32[B,T,D] -> q f32[B,T,N,hd], k, v f32[B,T,K,hd] (before RoPE)
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(B, T, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(B, T, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def mask(self, full_mask):  # bool[B,T,T] -> this layer's: the window band on a sliding layer
        if self.sliding_window is None:
            return full_mask
        T = full_mask.shape[-1]
        return full_mask & causal_mask(jnp.ones((1, T), jnp.int32), self.sliding_window)

    def __call__(self, x, inputs: LayerInputs):  # x: f32[B,T,D] -> f32[B,T,D]
        q, k, v = self.project_qkv(x)
        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
        out = eager_attention(q, k, v, self.mask(inputs.mask), self.scaling, sinks=self.sinks)
        B, T, N, hd = out.shape
        return self.o_proj(out.reshape(B, T, N * hd))


class GptOssTopKRouter(nn.Module):
    """logits = x W^T + b with HF's weight f32[E,D] (a Parameter, not an nn.Linear: no LoRA target)."""
    config: GptOssConfig

    @nn.compact
    def __call__(self, x):  # f32[T,D] -> (logits f32[T,E], weights f32[T,k], indices i32[T,k])
        c = self.config
        E, D = c.num_local_experts, c.hidden_size
        weight = self.param("weight", nn.initializers.normal(0.02), (E, D), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (E,), jnp.float32)
        logits = jnp.dot(x, weight.T, precision=HIGHEST) + bias
        return (logits, *route(logits, c.num_experts_per_tok))


class GptOssExperts(nn.Module):
    """The experts as one grouped matmul.

    The T*k assignments (token t, its j-th expert) are sorted by expert (a stable argsort), the tokens
    gathered into that order, and jax.lax.ragged_dot multiplies each contiguous group of rows by its
    expert's matrix (group sizes = tokens per expert). Shapes stay static (T*k rows whatever the
    routing), so one jit serves every batch. The rows are gathered back to their (t, j) slots and
    summed in ascending expert order from zero, the order of transformers' index_add_ loop. (On CPU
    XLA lowers ragged_dot densely, masked per group; GPU and TPU have grouped lowerings.)
    """
    config: GptOssConfig

    def setup(self):
        c = self.config
        E, D, I = c.num_local_experts, c.hidden_size, c.intermediate_size
        init = nn.initializers.normal(0.02)
        self.gate_up_proj = self.param("gate_up_proj", init, (E, D, 2 * I), jnp.float32)
        self.gate_up_proj_bias = self.param("gate_up_proj_bias", nn.initializers.zeros_init(), (E, 2 * I), jnp.float32)
        self.down_proj = self.param("down_proj", init, (E, I, D), jnp.float32)
        self.down_proj_bias = self.param("down_proj_bias", nn.initializers.zeros_init(), (E, D), jnp.float32)

    def __call__(self, x, indices, weights):
        """x f32[T,D], indices i32[T,k], weights f32[T,k] (route's) -> f32[T,D]."""
        c = self.config
        T, k = indices.shape
        # Each token's k assignments in ascending expert order: the summation order of transformers.
        by_expert = jnp.argsort(indices, axis=-1)
        indices = jnp.take_along_axis(indices, by_expert, axis=-1)
        weights = jnp.take_along_axis(weights, by_expert, axis=-1)
        expert = indices.reshape(T * k)  # i32[T*k]: assignment a = t*k + j
        order = jnp.argsort(expert, stable=True)  # assignments grouped by expert
        sorted_expert = expert[order]
        group_sizes = jnp.bincount(expert, length=c.num_local_experts).astype(jnp.int32)  # i32[E]
        xs = x[order // k]  # f32[T*k,D]: each assignment's token
        h = jax.lax.ragged_dot(xs, self.gate_up_proj, group_sizes, precision=HIGHEST)
        h = swiglu_clamped(h + self.gate_up_proj_bias[sorted_expert], c.swiglu_alpha, c.swiglu_limit)
        y = jax.lax.ragged_dot(h, self.down_proj, group_sizes, precision=HIGHEST)
        y = y + self.down_proj_bias[sorted_expert]  # f32[T*k,D]
        y = y[jnp.argsort(order)].reshape(T, k, -1) * weights[..., None]  # back to slot (t, j)
        out = jnp.zeros_like(x)
        for j in range(k):  # k is a small constant (2 or 4): an unrolled, ordered sum
            out = out + y[:, j]
        return out


class GptOssMLP(nn.Module):
    """router + experts on the flattened tokens: f32[B,T,D] -> f32[B,T,D]."""
    config: GptOssConfig

    def setup(self):
        self.router = GptOssTopKRouter(self.config)
        self.experts = GptOssExperts(self.config)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.router(flat)
        return self.experts(flat, indices, weights).reshape(x.shape)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x))."""
    config: GptOssConfig
    layer_idx: int = 0
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.self_attn = GptOssAttention(c, self.layer_idx, self.lora_scaling)
        self.mlp = GptOssMLP(c)
        self.input_layernorm = RMSNorm(c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps)

    def __call__(self, hidden, inputs: LayerInputs):  # f32[B,T,D] -> f32[B,T,D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GptOssModel(nn.Module):
    config: GptOssConfig
    lora_scaling: float = 2.0

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        self.layers = [GptOssDecoderLayer(c, i, self.lora_scaling) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)

    def __call__(self, input_ids, attention_mask, position_ids=None):  # i32[B,T] x3 -> f32[B,T,D]
        inputs = layer_inputs(self.config, attention_mask, position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, inputs)
        return self.norm(hidden)


class GptOssForCausalLM(nn.Module):
    """logits = model.apply({"params": params[, "lora": adapters]}, input_ids, attention_mask)."""
    config: GptOssConfig
    lora_scaling: float = 2.0  # lora_alpha / r, used only where a "lora" collection is given

    def setup(self):
        self.model = GptOssModel(self.config, self.lora_scaling)
        if not self.config.tie_word_embeddings:  # the release's head is untied
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False)

    def final_logits(self, hidden):  # f32[..., D] (after the final norm) -> f32[..., V]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, return_hidden: bool = False):
        """i32[B,T] (x3) -> logits f32[B,T,V], or (logits, final hidden states f32[B,T,D]) with return_hidden."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids)
        logits = self.final_logits(hidden)
        return (logits, hidden) if return_hidden else logits
