"""AutoModelForCausalLM for the Flax twins: a checkpoint directory's `model_type` picks the family.

Twin of torch_sources/models/auto.py (the same rows, `AUTO_MODEL` in each family file). The family's converter
(conversion/<family>.py) reads the checkpoint torch-free.
"""
from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

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
