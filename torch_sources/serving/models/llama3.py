"""Llama 3 over the paged KV cache: the training-side modules (torch_sources/models/llama3.py) run on a flat
ragged batch of tokens, with attention replaced by write_to_kv_cache + ragged_paged_attention.

The projections, norms, RoPE and MLP are the training model's own submodules and operators; only the
attention core differs (it reads K/V through the block table instead of a dense [B,T] batch).
"""
from __future__ import annotations

import torch

from torch_sources.models.llama3 import LlamaConfig, LlamaForCausalLM, apply_rope, rope_cos_sin, rope_inv_freq
from torch_sources.serving.paged_attention import AttentionMetadata, PagedKVCache, ragged_paged_attention, \
    write_to_kv_cache

__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]


def load_model(model_dir) -> tuple[LlamaConfig, LlamaForCausalLM]:
    model = LlamaForCausalLM.from_pretrained(model_dir)
    return model.config, model


def _rope(model: LlamaForCausalLM, positions):  # i32[T] -> (cos, sin) f32[1,T,hd]
    return rope_cos_sin(rope_inv_freq(model.config), torch.as_tensor(positions)[None])


def _layer(model, i, hidden, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
    # hidden f32[1,T,D] -> f32[1,T,D]; writes this step's K/V of layer i into the cache.
    layer = model.model.layers[i]
    attn = layer.self_attn
    T, N, K, hd = hidden.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = layer.input_layernorm(hidden)
    q = apply_rope(attn.q_proj(x).view(1, T, N, hd), cos, sin)[0]  # f32[T,N,hd]
    k = apply_rope(attn.k_proj(x).view(1, T, K, hd), cos, sin)[0]  # f32[T,K,hd]
    v = attn.v_proj(x).view(T, K, hd)
    write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k, v, meta.slot_mapping)
    out = ragged_paged_attention(q, kv_cache.k[i], kv_cache.v[i], meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                 meta.num_seqs, sm_scale=hd ** -0.5)  # f32[T,N,hd]
    hidden = hidden + attn.o_proj(out.reshape(1, T, N * hd))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@torch.no_grad()
def decoder_layer_paged(model: LlamaForCausalLM, layer_idx: int, hidden, positions, kv_cache: PagedKVCache,
                        attn_meta: AttentionMetadata):
    """One decoder layer on a ragged batch: hidden f32[T,D], positions i32[T] -> (hidden f32[T,D], kv_cache)
    with this step's K/V of layer layer_idx written into kv_cache."""
    cos, sin = _rope(model, positions)
    return _layer(model, layer_idx, hidden[None], cos, sin, kv_cache, attn_meta)[0], kv_cache


@torch.no_grad()
def forward_paged(model: LlamaForCausalLM, input_ids, positions, kv_cache: PagedKVCache,
                  attn_meta: AttentionMetadata):
    """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
    cos, sin = _rope(model, positions)
    hidden = model.model.embed_tokens(torch.as_tensor(input_ids, dtype=torch.int64))[None]  # f32[1,T,D]
    for i in range(model.config.num_hidden_layers):
        hidden = _layer(model, i, hidden, cos, sin, kv_cache, attn_meta)
    return model.model.norm(hidden)[0], kv_cache


@torch.no_grad()
def compute_logits(model: LlamaForCausalLM, hidden):  # f32[n,D] -> f32[n,V]
    return model.lm_head(hidden)
