"""AutoModelForCausalLM for the Flax twins: a checkpoint directory's `model_type` picks the family.

Twin of torch_sources/models/auto.py (same table). The family's converter (conversion/<family>.py)
reads the checkpoint torch-free.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

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
    path = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"cannot read {path}: {e}") from None
    if model_type not in MODEL_TYPES:
        raise OSError(f"{model_dir}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type][0]


def family_module(family: str):
    return importlib.import_module(f"jax_oracles.models.{family}")


def causal_lm_class(model_dir):
    family = family_of(model_dir)
    return getattr(family_module(family), next(c for f, c in MODEL_TYPES.values() if f == family))


def from_pretrained(model_dir, lora_scaling: float = 2.0):
    """(Linen module, params) of the checkpoint: the family's module at its config, the converter's params."""
    conversion = importlib.import_module(f"conversion.{family_of(model_dir)}")
    module = causal_lm_class(model_dir)(conversion.load_config(model_dir), lora_scaling=lora_scaling)
    return module, conversion.load_params(model_dir)
