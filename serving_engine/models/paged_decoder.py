"""Pre-norm decoder families over the paged KV cache (Llama 3, Qwen2, Qwen3, GPT-OSS, Qwen2.5-VL's language
model): twin of torch_sources/serving/models/paged_decoder.py.

The math is the family's Linen modules (jax_oracles/models/<family>.py), each bound to its own param
subtree: the layer's attention (its `project_qkv` hook gives q, k, v before RoPE, with Qwen2's biases and
Qwen3's per-head q/k norms), its MLP (GPT-OSS: the MoE), its RMSNorms. What a family adds is read off its
own modules: an attention may carry `sliding_window`, `sinks` and `scaling`, and the language model's config
(a vision-language config's `text`, else the config itself) carries its `rope` (jax_oracles/models/rope.py): the
table and YaRN's factor on cos and sin (a rope whose table moves with the sequence length, longrope or dynamic, is
refused; a family whose positions are not one row, M-RoPE, passes its own `rope_tables`). Only the attention core
differs from the training model: the step's new K/V
are written to the paged cache by slot and the queries attend over the cache through the block table
(ragged, bottom-right causal), so prefill, decode and chunked prefill of many sequences are one flat call
over T tokens.
"""
from __future__ import annotations

from types import SimpleNamespace

import flax.linen as nn

from jax_oracles.models import rope
from jax_oracles.models.layers import RMSNorm, apply_rope, rope_cos_sin
from serving_engine.models.common import PagedModel
from serving_engine.paged_attention import (AttentionMetadata, PagedKVCache, ragged_paged_attention,
                                            write_to_kv_cache)

__all__ = ["paged_functions"]


def _text(config):  # the language model's config: a vision-language config's `text`, else the config itself
    return getattr(config, "text", config)


def paged_functions(causal_lm, conversion, *, attention=None, mlp=None, rope_tables=None) -> SimpleNamespace:
    """The four functions the model runner calls (load_model, forward_paged, decoder_layer_paged,
    compute_logits) for a pre-norm Linen causal LM class whose (language model's) config carries its `rope`,
    and its conversion module (load_config, load_params); and the two forward_paged is made of: `embed` (the
    token embeddings) and `forward_embeds` (the layers and the final norm on given embeddings: a multimodal family
    merges its image rows in between). `attention(config, layer_idx)` and `mlp(config)` build layer i's modules
    from the language model's config; by default the Llama blocks' `attention` and `feed_forward` of
    `causal_lm.decoder_layer`. `rope_tables(config, positions) -> (cos, sin) f32[1,T,hd]` replaces the 1-D RoPE
    of positions i32[T]."""
    if attention is None:
        attention = lambda config, i: causal_lm.decoder_layer.attention(config)  # noqa: E731
    if mlp is None:
        mlp = causal_lm.decoder_layer.feed_forward

    def load_model(model_dir):
        """(config, PagedModel(config, Linen params)) of an HF checkpoint directory."""
        config = conversion.load_config(model_dir)
        rope.static_inv_freq(_text(config).rope, f"serving {model_dir}")  # refuse before any request
        return config, PagedModel(config, conversion.load_params(model_dir))

    def _rope(config, positions):  # i32[T] -> (cos, sin) f32[1,T,hd]
        if rope_tables is not None:
            return rope_tables(config, positions)
        r = _text(config).rope
        return rope_cos_sin(rope.static_inv_freq(r, "the paged engine"), positions[None], rope.attention_factor(r))

    def _norm(params, x, eps: float):
        return RMSNorm(eps).apply({"params": params}, x)

    def _layer(model: PagedModel, i: int, hidden, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
        # hidden f32[1,T,D] -> (f32[1,T,D], kv_cache with this step's K/V of layer i written).
        c, p = _text(model.config), model.params["model"][f"layers_{i}"]
        attn = attention(c, i).bind({"params": p["self_attn"]})
        T = hidden.shape[1]
        q, k, v = attn.project_qkv(_norm(p["input_layernorm"], hidden, c.rms_norm_eps))  # [1,T,N|K,hd]
        q, k = apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]
        k_pages, v_pages = write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k, v[0], meta.slot_mapping)
        kv_cache = kv_cache.replace_layer(i, k_pages, v_pages)
        out = ragged_paged_attention(q, k_pages, v_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                     meta.num_seqs, sm_scale=getattr(attn, "scaling", c.head_dim ** -0.5),
                                     sliding_window=getattr(attn, "sliding_window", None),
                                     sinks=getattr(attn, "sinks", None), impl=meta.impl,
                                     max_q_len=meta.max_q_len)  # f32[T,N,hd]
        hidden = hidden + attn.o_proj(out.reshape(1, T, -1))
        mlp_in = _norm(p["post_attention_layernorm"], hidden, c.rms_norm_eps)
        return hidden + mlp(c).apply({"params": p["mlp"]}, mlp_in), kv_cache

    def decoder_layer_paged(model: PagedModel, layer_idx: int, hidden, positions, kv_cache: PagedKVCache,
                            attn_meta: AttentionMetadata):
        """One decoder layer on a ragged batch: hidden f32[T,D], positions i32[T] -> (hidden f32[T,D],
        kv_cache) with this step's K/V of layer layer_idx written into kv_cache."""
        cos, sin = _rope(model.config, positions)
        hidden, kv_cache = _layer(model, layer_idx, hidden[None], cos, sin, kv_cache, attn_meta)
        return hidden[0], kv_cache

    def embed(model: PagedModel, input_ids):  # i32[T] -> f32[T,D]
        c = _text(model.config)
        return nn.Embed(c.vocab_size, c.hidden_size).apply({"params": model.params["model"]["embed_tokens"]},
                                                           input_ids)

    def forward_embeds(model: PagedModel, embeds, positions, kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
        """embeds f32[T,D], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
        c, m = _text(model.config), model.params["model"]
        cos, sin = _rope(model.config, positions)
        hidden = embeds[None]  # f32[1,T,D]
        for i in range(c.num_hidden_layers):
            hidden, kv_cache = _layer(model, i, hidden, cos, sin, kv_cache, attn_meta)
        return _norm(m["norm"], hidden, c.rms_norm_eps)[0], kv_cache

    def forward_paged(model: PagedModel, input_ids, positions, kv_cache: PagedKVCache,
                      attn_meta: AttentionMetadata):
        """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache). Padding tokens
        carry slot -1 and sit past cu_q_lens[num_seqs]; their rows are garbage the caller never reads."""
        return forward_embeds(model, embed(model, input_ids), positions, kv_cache, attn_meta)

    def compute_logits(model: PagedModel, hidden):  # f32[n,D] -> f32[n,V]
        c, params = _text(model.config), model.params
        if c.tie_word_embeddings:  # the embedding doubles as the output head
            return hidden @ params["model"]["embed_tokens"]["embedding"].T
        return nn.Dense(c.vocab_size, use_bias=False).apply({"params": params["lm_head"]}, hidden)

    return SimpleNamespace(load_model=load_model, forward_paged=forward_paged,
                           decoder_layer_paged=decoder_layer_paged, compute_logits=compute_logits,
                           embed=embed, forward_embeds=forward_embeds)
