"""Qwen3 over the paged KV cache: the pre-norm decoder serving path (serving_engine/models/paged_decoder.py) on
the modules of jax_oracles/models/qwen3.py (per-head q_norm / k_norm before RoPE, an explicit head_dim)."""
from __future__ import annotations

from conversion import qwen3 as conversion
from jax_oracles.models.qwen3 import Qwen3ForCausalLM
from serving_engine.models.paged_decoder import paged_functions

SERVES = ("qwen3",)  # the config.json model_types this module serves (models/__init__.py finds them here)
__all__ = ["load_model", "forward_paged", "decoder_layer_paged", "compute_logits"]

_PAGED = paged_functions(Qwen3ForCausalLM, conversion)
load_model, forward_paged = _PAGED.load_model, _PAGED.forward_paged
decoder_layer_paged, compute_logits = _PAGED.decoder_layer_paged, _PAGED.compute_logits
