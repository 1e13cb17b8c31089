"""Gemma 4 over the paged KV cache: twin of torch_sources/serving/models/gemma4.py, built on the Linen
model's serving hooks (jax_oracles/models/gemma4.py: `embed`, `per_layer_inputs`, `rope`, `project_qkv`,
`project_output`, `after_attention`, `final_logits`), called on the model bound to its params.

Per layer type: sliding layers attend with the config's window, full layers without; the two types may
have different head dims, so each layer reads its own cache. A KV-shared layer (the last
num_kv_shared_layers) computes only q and attends over the cache of `kv_source_layer(i)`, written earlier
in the same forward pass; it writes nothing.
"""
from __future__ import annotations

from conversion.gemma4 import load_config, load_params
from jax_oracles.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig
from serving_engine.models.common import PagedModel
from serving_engine.paged_attention import (AttentionMetadata, PagedKVCache, ragged_paged_attention,
                                            write_to_kv_cache)

SERVES = ("gemma4_text", "gemma4")  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]


def load_model(model_dir) -> tuple[Gemma4TextConfig, PagedModel]:
    """(config, PagedModel(config, Linen params)) of an HF Gemma 4 text checkpoint directory."""
    config = load_config(model_dir)
    return config, PagedModel(config, load_params(model_dir))


def _bind(model: PagedModel):  # the Linen model bound to its params: hooks become plain calls
    return Gemma4ForCausalLM(model.config).bind({"params": model.params})


def _layer(lm, i, hidden, per_layer_input, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
    # hidden f32[1,T,D], per_layer_input f32[1,T,P], cos/sin f32[1,T,hd] of the layer type
    # -> (f32[1,T,D], kv_cache with layer i's K/V written unless it is KV-shared).
    layer = lm.model.layers[i]
    attn = layer.self_attn
    q, k, v = attn.project_qkv(layer.input_layernorm(hidden), cos, sin)  # f32[1,T,N,hd], f32[1,T,K,hd] | None
    if k is not None:
        k_pages, v_pages = write_to_kv_cache(kv_cache.k[i], kv_cache.v[i], k[0], v[0], meta.slot_mapping)
        kv_cache = kv_cache.replace_layer(i, k_pages, v_pages)
    src = attn.kv_source
    out = ragged_paged_attention(q[0], kv_cache.k[src], kv_cache.v[src], meta.kv_lens, meta.page_indices,
                                 meta.cu_q_lens, meta.num_seqs, sm_scale=attn.scaling,
                                 sliding_window=attn.sliding_window, impl=meta.impl,
                                 max_q_len=meta.max_q_len)  # f32[T,N,hd]
    return layer.after_attention(hidden, attn.project_output(out[None]), per_layer_input), kv_cache


def _ple_of(ple, i):  # f32[1,T,L,P] | None (no per-layer inputs) -> layer i's f32[1,T,P] | None
    return None if ple is None else ple[:, :, i]


def _ple_row(per_layer_input):  # f32[T,P] | None -> f32[1,T,P] | None
    return None if per_layer_input is None else per_layer_input[None]


def _inputs(lm, input_ids, positions):
    """-> scaled embeddings f32[1,T,D], per-layer inputs f32[1,T,L,P] (None without PLE),
    {layer_type: (cos, sin) f32[1,T,hd]}."""
    ids = input_ids[None]
    hidden = lm.model.embed(ids)
    return hidden, lm.model.per_layer_inputs(ids, hidden), lm.model.rope(positions[None])


def decoder_layer_paged(model: PagedModel, layer_idx: int, hidden, per_layer_input, positions,
                        kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
    """One decoder layer on a ragged batch: hidden f32[T,D], per_layer_input f32[T,P] (PLE slice of this
    layer; None, or ignored, without PLE), positions i32[T] -> (hidden f32[T,D], kv_cache) with layer
    layer_idx's K/V written (none if the layer is KV-shared)."""
    lm = _bind(model)
    cos, sin = lm.model.rope(positions[None])[model.config.layer_types[layer_idx]]
    hidden, kv_cache = _layer(lm, layer_idx, hidden[None], _ple_row(per_layer_input), cos, sin, kv_cache, attn_meta)
    return hidden[0], kv_cache


def forward_paged(model: PagedModel, input_ids, positions, kv_cache: PagedKVCache, attn_meta: AttentionMetadata):
    """input_ids i32[T], positions i32[T] -> (final-normed hidden f32[T,D], kv_cache)."""
    lm = _bind(model)
    hidden, ple, rope = _inputs(lm, input_ids, positions)
    for i, layer_type in enumerate(model.config.layer_types):
        hidden, kv_cache = _layer(lm, i, hidden, _ple_of(ple, i), *rope[layer_type], kv_cache, attn_meta)
    return lm.model.norm(hidden)[0], kv_cache


def compute_logits(model: PagedModel, hidden):  # f32[n,D] -> f32[n,V], soft-capped
    return _bind(model).final_logits(hidden)
