"""GPT-OSS over the paged KV cache: the pre-norm decoder serving path (serving/models/paged_decoder.py) on the
training-side modules of torch_sources/models/gpt_oss.py. Each layer's attention carries its window (the
config's on sliding layers, None on full ones) and its per-head sinks; the YaRN cos/sin carry the attention
factor; the MoE MLP runs unchanged on the ragged tokens. Every layer caches (num_key_value_heads, head_dim),
so layer_kv_shapes' uniform allocation fits."""
from __future__ import annotations

from torch_sources.models.gpt_oss import GptOssForCausalLM
from torch_sources.serving.models.paged_decoder import paged_functions

SERVES = ("gpt_oss",)  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]

_PAGED = paged_functions(GptOssForCausalLM)
load_model, forward_paged = _PAGED.load_model, _PAGED.forward_paged
decoder_layer_paged, compute_logits = _PAGED.decoder_layer_paged, _PAGED.compute_logits
