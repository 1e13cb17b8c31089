"""AutoModelForCausalLM, as LLaMA-Factory's loader uses it: a checkpoint directory's `model_type` picks the family.

One row per recorded family: HF model_type -> (family file under models/, causal-LM class). The JAX twin
(jax_oracles/models/auto.py) holds the same table.
"""
from __future__ import annotations

import importlib

from torch_sources.models.loading import CheckpointError, load_config

__all__ = ["MODEL_TYPES", "family_of", "family_module", "causal_lm_class", "from_pretrained"]

MODEL_TYPES = {
    "llama": ("llama3", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi4", "Phi3ForCausalLM"),
    "bloom": ("bloom", "BloomForCausalLM"),
    "falcon": ("falcon", "FalconForCausalLM"),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}


def family_of(model_dir) -> str:
    """The family file name (llama3, phi4, ...) of a checkpoint directory, from its config.json model_type."""
    model_type = load_config(model_dir).get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{model_dir}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type][0]


def family_module(family: str):
    return importlib.import_module(f"torch_sources.models.{family}")


def causal_lm_class(model_dir):
    family = family_of(model_dir)
    return getattr(family_module(family), next(c for f, c in MODEL_TYPES.values() if f == family))


def from_pretrained(model_dir):
    """The checkpoint's causal LM in fp32, eval mode."""
    return causal_lm_class(model_dir).from_pretrained(model_dir)
