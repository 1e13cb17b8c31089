"""Llama 3 over the paged KV cache: the pre-norm decoder serving path (serving_engine/models/paged_decoder.py)
on the modules of jax_oracles/models/llama3.py."""
from __future__ import annotations

from conversion import llama3 as conversion
from jax_oracles.models.llama3 import LlamaForCausalLM
from serving_engine.models.paged_decoder import paged_functions

SERVES = ("llama",)  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]

_PAGED = paged_functions(LlamaForCausalLM, conversion)
load_model, forward_paged = _PAGED.load_model, _PAGED.forward_paged
decoder_layer_paged, compute_logits = _PAGED.decoder_layer_paged, _PAGED.compute_logits
