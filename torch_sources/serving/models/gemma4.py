"""Gemma 4 over the paged KV cache, built on the training-side model's serving hooks
(torch_sources/models/gemma4.py: `embed`, `per_layer_inputs`, `rope`, `project_qkv`, `project_output`,
`after_attention`, `final_logits`).

Per layer type: sliding layers attend with the config's window, full layers without; the two types may
have different head dims, so each layer reads its own cache. A KV-shared layer (the last
num_kv_shared_layers) computes only q and attends over the cache of `kv_source_layer(i)`, written earlier
in the same forward pass; it writes nothing.
"""
from __future__ import annotations

import torch

from torch_sources.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig
from torch_sources.serving.paged_attention import AttentionMetadata, PagedKVCache, ragged_paged_attention, \
    write_to_kv_cache

SERVES = ("gemma4_text", "gemma4")  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]


def load_model(model_dir) -> tuple[Gemma4TextConfig, Gemma4ForCausalLM]:
    model = Gemma4ForCausalLM.from_pretrained(model_dir)
    return model.config, model


def _layer(model, i, hidden, per_layer_input, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
    # hidden f32[1,T,D], per_layer_input f32[1,T,P], cos/sin f32[1,T,hd] of the layer type -> f32[1,T,D].
    layer = model.model.layers[i]
    attn = layer.self_attn
    q, k, v = attn.project_qkv(layer.input_layernorm(hidden), cos, sin)  # f32[1,T,N,hd], f32[1,T,K,hd] | None
    src = attn.kv_source
    if k is not None:
        write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k[0], v[0], meta.slot_mapping)
    out = ragged_paged_attention(q[0], kv_cache.k[src], kv_cache.v[src], meta.kv_lens, meta.page_indices,
                                 meta.cu_q_lens, meta.num_seqs, sm_scale=attn.scaling,
                                 sliding_window=attn.sliding_window)  # f32[T,N,hd]
    return layer.after_attention(hidden, attn.project_output(out[None]), per_layer_input)


def _ple_of(ple, i):  # f32[1,T,L,P] | None (no per-layer inputs) -> layer i's f32[1,T,P] | None
    return None if ple is None else ple[:, :, i]


def _ple_row(per_layer_input):  # f32[T,P] | None -> f32[1,T,P] | None
    return None if per_layer_input is None else per_layer_input[None]


def _inputs(model, input_ids, positions):
    """-> scaled embeddings f32[1,T,D], per-layer inputs f32[1,T,L,P] (None without PLE),
    {layer_type: (cos, sin) f32[1,T,hd]}."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64)[None]
    hidden = model.model.embed(ids)
    return hidden, model.model.per_layer_inputs(ids, hidden), model.model.rope(torch.as_tensor(positions)[None])


@torch.no_grad()
def decoder_layer_paged(model: Gemma4ForCausalLM, layer_idx: int, hidden, per_layer_input, positions,
                        kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
    """One decoder layer on a ragged batch: hidden f32[T,D], per_layer_input f32[T,P] (PLE slice of this
    layer; None, or ignored, without PLE), positions i32[T] -> (hidden f32[T,D], kv_cache) with layer
    layer_idx's K/V written (none if the layer is KV-shared)."""
    cos, sin = model.model.rope(torch.as_tensor(positions)[None])[model.config.layer_types[layer_idx]]
    hidden = _layer(model, layer_idx, hidden[None], _ple_row(per_layer_input), cos, sin, kv_cache, attn_meta)
    return hidden[0], kv_cache


@torch.no_grad()
def forward_paged(model: Gemma4ForCausalLM, input_ids, positions, kv_cache: PagedKVCache,
                  attn_meta: AttentionMetadata):
    """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
    hidden, ple, rope = _inputs(model, input_ids, positions)
    for i, layer_type in enumerate(model.config.layer_types):
        hidden = _layer(model, i, hidden, _ple_of(ple, i), *rope[layer_type], kv_cache, attn_meta)
    return model.model.norm(hidden)[0], kv_cache


@torch.no_grad()
def compute_logits(model: Gemma4ForCausalLM, hidden):  # f32[n,D] -> f32[n,V], soft-capped
    return model.final_logits(hidden)
