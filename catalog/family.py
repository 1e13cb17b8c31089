"""A family's model as its yaml names it (configs/family/<name>.yaml), for the recorder and the grader's sandboxed
child alike: plain dict access, no Hydra (the verifier environment has none)."""
from __future__ import annotations

__all__ = ["model_class_name", "language_model", "mirrored_modules"]


def model_class_name(family) -> str:
    """The whole model's class in the family module: `model_class`, else <model_prefix>ForCausalLM."""
    return family.get("model_class") or f"{family['model_prefix']}ForCausalLM"


def language_model(family) -> tuple[str, str]:
    """(module, class prefix) of the decoder the layer checks read: `language_model` (a vision-language family's
    text family, e.g. models/qwen2.py, Qwen2), else the family's own."""
    lm = family.get("language_model") or {}
    return lm.get("module", family["model_module"]), lm.get("prefix", family["model_prefix"])


def mirrored_modules(family) -> list[str]:
    """The family's modules a candidate mirrors (L0/layout): model_module, then `mirrored` (a vision-language
    family's decoder, tower, positions, processor and mm plugin)."""
    return list(dict.fromkeys([family["model_module"], *(family.get("mirrored") or ())]))
