"""Serving-side model families: each module runs its training-side model over the paged KV cache.

`load_model(model_dir)` dispatches on config.json's model_type; `family(model_dir)` gives the module
(forward_paged, decoder_layer_paged, compute_logits) the runner calls.
"""
from __future__ import annotations

from types import ModuleType

from torch_sources.models.loading import load_config
from torch_sources.serving.models import gemma4, gpt_oss, llama3, qwen2, qwen3

__all__ = ["FAMILIES", "family", "load_model"]

# config.json model_type -> serving module
# (a Gemma 4 release is "gemma4", the multimodal config; its language model is served)
FAMILIES: dict[str, ModuleType] = {"llama": llama3, "qwen2": qwen2, "qwen3": qwen3, "gemma4_text": gemma4,
                                 "gemma4": gemma4, "gpt_oss": gpt_oss}


def family(model_dir) -> ModuleType:
    model_type = load_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{model_dir}: model_type {model_type!r} is not served (known: {sorted(FAMILIES)})")
    return FAMILIES[model_type]


def load_model(model_dir):
    """-> (config, model) of the family named by config.json's model_type, fp32, eval mode."""
    return family(model_dir).load_model(model_dir)
