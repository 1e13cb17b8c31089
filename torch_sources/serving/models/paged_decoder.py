"""Pre-norm decoder families over the paged KV cache: Llama 3, Qwen2, Qwen3, GPT-OSS and Qwen2.5-VL's language model.

A family's training-side modules (torch_sources/models/<family>.py) run on a flat ragged batch of tokens;
only the attention core differs: the step's K/V are written to the cache by slot (write_to_kv_cache) and
the queries attend through the block table (ragged_paged_attention). What a family adds is read off its
own modules, never branched on by name:
- the attention's `project_qkv` hook gives q, k, v before RoPE (Qwen2's biases, Qwen3's per-head q/k norms);
- an attention may carry `sliding_window` (None on a full layer), `sinks` (GPT-OSS: one logit per query
  head in the softmax normaliser) and `scaling` (else 1/sqrt(head_dim));
- the language model's config (a vision-language config's `text`, else the config itself) carries its `rope`
  (models/rope.py): the table and the attention factor (YaRN's) of cos and sin; a rope whose table moves with
  the sequence length (longrope, dynamic) is refused. A family whose positions are not one row (M-RoPE) passes
  its own `rope_tables`.
So a family's serving file is one call of `paged_functions`.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from torch_sources.models import rope
from torch_sources.models.layers import apply_rope, rope_cos_sin
from torch_sources.serving.paged_attention import AttentionMetadata, PagedKVCache, ragged_paged_attention, \
    write_to_kv_cache

__all__ = ["paged_functions"]


def _text(config):  # the language model's config: a vision-language config's `text`, else the config itself
    return getattr(config, "text", config)


def paged_functions(causal_lm, *, rope_tables=None) -> SimpleNamespace:
    """The four functions the model runner calls (load_model, forward_paged, decoder_layer_paged,
    compute_logits) for a pre-norm causal LM class whose (language model's) config carries its `rope`, and the
    two forward_paged is made of: `embed` (the token embeddings) and `forward_embeds` (the layers and the final
    norm on given embeddings: a multimodal family merges its image rows in between).
    `rope_tables(config, positions) -> (cos, sin) f32[1,T,hd]` replaces the 1-D RoPE of positions i32[T]."""

    def load_model(model_dir):
        model = causal_lm.from_pretrained(model_dir)
        rope.static_inv_freq(_text(model.config).rope, f"serving {model_dir}")  # refuse before any request
        return model.config, model

    def _rope(model, positions):  # i32[T] -> (cos, sin) f32[1,T,hd]
        if rope_tables is not None:
            return rope_tables(model.config, positions)
        r = _text(model.config).rope
        return rope_cos_sin(rope.static_inv_freq(r, "the paged engine"), torch.as_tensor(positions)[None],
                            rope.attention_factor(r))

    def _layer(model, i, hidden, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
        # hidden f32[1,T,D] -> f32[1,T,D]; writes this step's K/V of layer i into the cache.
        layer = model.model.layers[i]
        attn = layer.self_attn
        T = hidden.shape[1]
        q, k, v = attn.project_qkv(layer.input_layernorm(hidden))  # f32[1,T,N,hd], f32[1,T,K,hd]
        q, k = apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]
        write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k, v[0], meta.slot_mapping)
        out = ragged_paged_attention(q, kv_cache.k[i], kv_cache.v[i], meta.kv_lens, meta.page_indices,
                                     meta.cu_q_lens, meta.num_seqs,
                                     sm_scale=getattr(attn, "scaling", attn.head_dim ** -0.5),
                                     sliding_window=getattr(attn, "sliding_window", None),
                                     sinks=getattr(attn, "sinks", None))  # f32[T,N,hd]
        hidden = hidden + attn.o_proj(out.reshape(1, T, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @torch.no_grad()
    def decoder_layer_paged(model, layer_idx: int, hidden, positions, kv_cache: PagedKVCache,
                            attn_meta: AttentionMetadata):
        """One decoder layer on a ragged batch: hidden f32[T,D], positions i32[T] -> (hidden f32[T,D],
        kv_cache) with this step's K/V of layer layer_idx written into kv_cache."""
        cos, sin = _rope(model, positions)
        return _layer(model, layer_idx, hidden[None], cos, sin, kv_cache, attn_meta)[0], kv_cache

    @torch.no_grad()
    def embed(model, input_ids):  # i32[T] -> f32[T,D]
        return model.model.embed_tokens(torch.as_tensor(input_ids, dtype=torch.int64))

    @torch.no_grad()
    def forward_embeds(model, embeds, positions, kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
        """embeds f32[T,D], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
        cos, sin = _rope(model, positions)
        hidden = embeds[None]  # f32[1,T,D]
        for i in range(model.config.num_hidden_layers):
            hidden = _layer(model, i, hidden, cos, sin, kv_cache, attn_meta)
        return model.model.norm(hidden)[0], kv_cache

    def forward_paged(model, input_ids, positions, kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
        """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
        return forward_embeds(model, embed(model, input_ids), positions, kv_cache, attn_meta)

    @torch.no_grad()
    def compute_logits(model, hidden):  # f32[n,D] -> f32[n,V] (a tied head is the embedding)
        return model.lm_head(hidden)

    return SimpleNamespace(load_model=load_model, forward_paged=forward_paged,
                           decoder_layer_paged=decoder_layer_paged, compute_logits=compute_logits,
                           embed=embed, forward_embeds=forward_embeds)
