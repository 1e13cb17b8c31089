"""AutoModelForCausalLM, as LLaMA-Factory's loader uses it: a checkpoint directory's `model_type` picks the family.

One row per recorded family, kept in the family file (`AUTO_MODEL`): HF model_type -> (family file under
models/, causal-LM class). The JAX twin (jax_oracles/models/auto.py) finds the same rows in its own files.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

from torch_sources.models.loading import CheckpointError, load_config

__all__ = ["MODEL_TYPES", "family_of", "family_module", "causal_lm_class", "from_pretrained"]


def _registered() -> dict[str, tuple[str, str]]:
    """HF model_type -> (family file, causal-LM class), from each family file's AUTO_MODEL row, read statically
    (no family module is imported to find it): a new family registers in its own file."""
    rows = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "AUTO_MODEL" for t in node.targets):
                model_type, cls = ast.literal_eval(node.value)
                rows[model_type] = (path.stem, cls)
    return rows


MODEL_TYPES = _registered()


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
