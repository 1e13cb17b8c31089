"""Llama 3 over the paged KV cache: twin of torch_sources/serving/models/llama3.py.

The math is jax_oracles/models/llama3.py's: each sub-module (RMSNorm, projections, MLP, embedding) is the
oracle's Linen module applied to its own param subtree, and RoPE is the oracle's operator. Only the
attention core differs from the training model: the step's new K/V are written to the paged cache by slot
and the queries attend over the cache through the block table (ragged, bottom-right causal), so prefill,
decode and chunked prefill of many sequences are one flat call over T tokens.
"""
from __future__ import annotations

import flax.linen as nn

from conversion.llama3 import load_config, load_params
from jax_oracles.models.llama3 import (LlamaConfig, LlamaMLP, LlamaRMSNorm, apply_rope, rope_cos_sin,
                                       rope_inv_freq)
from jax_oracles.training.lora import LoraLinear
from serving_engine.models.common import PagedModel
from serving_engine.paged_attention import (AttentionMetadata, PagedKVCache, ragged_paged_attention,
                                            write_to_kv_cache)

__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]


def load_model(model_dir) -> tuple[LlamaConfig, PagedModel]:
    """(config, PagedModel(config, Linen params)) of an HF Llama checkpoint directory."""
    config = load_config(model_dir)
    return config, PagedModel(config, load_params(model_dir))


def _rope(config: LlamaConfig, positions):  # i32[T] -> (cos, sin) f32[1,T,hd]
    return rope_cos_sin(rope_inv_freq(config), positions[None])


def _linear(params, x, features: int, use_bias: bool):  # f32[...,in] -> f32[...,out]
    return LoraLinear(features, use_bias=use_bias).apply({"params": params}, x)


def _norm(params, x, eps: float):
    return LlamaRMSNorm(eps).apply({"params": params}, x)


def _layer(model: PagedModel, i: int, hidden, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
    # hidden f32[1,T,D] -> (f32[1,T,D], kv_cache with this step's K/V of layer i written).
    c, p = model.config, model.params["model"][f"layers_{i}"]
    a = p["self_attn"]
    T, N, K, hd = hidden.shape[1], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = _norm(p["input_layernorm"], hidden, c.rms_norm_eps)
    q = apply_rope(_linear(a["q_proj"], x, N * hd, c.attention_bias).reshape(1, T, N, hd), cos, sin)[0]
    k = apply_rope(_linear(a["k_proj"], x, K * hd, c.attention_bias).reshape(1, T, K, hd), cos, sin)[0]
    v = _linear(a["v_proj"], x, K * hd, c.attention_bias).reshape(T, K, hd)
    k_pages, v_pages = write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k, v, meta.slot_mapping)
    kv_cache = kv_cache.replace_layer(i, k_pages, v_pages)
    out = ragged_paged_attention(q, k_pages, v_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                 meta.num_seqs, sm_scale=hd ** -0.5, impl=meta.impl)  # f32[T,N,hd]
    hidden = hidden + _linear(a["o_proj"], out.reshape(1, T, N * hd), c.hidden_size, c.attention_bias)
    mlp_in = _norm(p["post_attention_layernorm"], hidden, c.rms_norm_eps)
    return hidden + LlamaMLP(c).apply({"params": p["mlp"]}, mlp_in), kv_cache


def decoder_layer_paged(model: PagedModel, layer_idx: int, hidden, positions, kv_cache: PagedKVCache,
                        attn_meta: AttentionMetadata):
    """One decoder layer on a ragged batch: hidden f32[T,D], positions i32[T] -> (hidden f32[T,D], kv_cache)
    with this step's K/V of layer layer_idx written into kv_cache."""
    cos, sin = _rope(model.config, positions)
    hidden, kv_cache = _layer(model, layer_idx, hidden[None], cos, sin, kv_cache, attn_meta)
    return hidden[0], kv_cache


def forward_paged(model: PagedModel, input_ids, positions, kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
    """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache). Padding tokens carry
    slot -1 and sit past cu_q_lens[num_seqs]; their rows are garbage the caller never reads."""
    c, m = model.config, model.params["model"]
    cos, sin = _rope(c, positions)
    hidden = nn.Embed(c.vocab_size, c.hidden_size).apply({"params": m["embed_tokens"]}, input_ids[None])
    for i in range(c.num_hidden_layers):
        hidden, kv_cache = _layer(model, i, hidden, cos, sin, kv_cache, attn_meta)
    return _norm(m["norm"], hidden, c.rms_norm_eps)[0], kv_cache


def compute_logits(model: PagedModel, hidden):  # f32[n,D] -> f32[n,V]
    c, params = model.config, model.params
    if c.tie_word_embeddings:  # as LlamaForCausalLM: the embedding doubles as the output head
        return hidden @ params["model"]["embed_tokens"]["embedding"].T
    return nn.Dense(c.vocab_size, use_bias=False).apply({"params": params["lm_head"]}, hidden)
