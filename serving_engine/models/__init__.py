"""Serving-side model families: each module runs its jax_oracles model over the paged KV cache.

Twin of torch_sources/serving/models/__init__.py. `load_model(model_dir)` dispatches on config.json's
model_type; `family(model_dir)` gives the module (forward_paged, decoder_layer_paged, compute_logits) the
runner calls. A family's "model" is a PagedModel: its config (static) and Linen params as one pytree.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from conversion.safetensors_io import load_config
from serving_engine.models.common import PagedModel

__all__ = ["FAMILIES", "PagedModel", "family", "load_model"]

# config.json model_type -> serving module
# (a Gemma 4 release is "gemma4", the multimodal config; its language model is served)
def _served() -> dict[str, ModuleType]:
    """model_type -> family module, from each module's SERVES row: a new family registers in its own file."""
    out = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model_type in getattr(module, "SERVES", ()):
            out[model_type] = module
    return out


FAMILIES: dict[str, ModuleType] = _served()


def family(model_dir) -> ModuleType:
    model_type = load_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{model_dir}: model_type {model_type!r} is not served (known: {sorted(FAMILIES)})")
    return FAMILIES[model_type]


def load_model(model_dir):
    """-> (config, PagedModel) of the family named by config.json's model_type."""
    return family(model_dir).load_model(model_dir)
