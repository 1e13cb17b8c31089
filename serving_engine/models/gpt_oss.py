"""GPT-OSS over the paged KV cache: the pre-norm decoder serving path (serving_engine/models/paged_decoder.py)
on the Linen modules of jax_oracles/models/gpt_oss.py. Each layer's attention carries its window (the
config's on sliding layers, None on full ones) and its per-head sinks; the YaRN cos/sin carry the attention
factor; the MoE MLP (a grouped matmul over the experts) runs on the flat token axis, padding rows included
(routed too; nobody reads them)."""
from __future__ import annotations

from conversion import gpt_oss as conversion
from jax_oracles.models.gpt_oss import GptOssAttention, GptOssForCausalLM, GptOssMLP
from serving_engine.models.paged_decoder import paged_functions

SERVES = ("gpt_oss",)  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]

_PAGED = paged_functions(GptOssForCausalLM, conversion, attention=GptOssAttention, mlp=GptOssMLP)
load_model, forward_paged = _PAGED.load_model, _PAGED.forward_paged
decoder_layer_paged, compute_logits = _PAGED.decoder_layer_paged, _PAGED.compute_logits
