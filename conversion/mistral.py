"""HF Mistral checkpoint -> Flax Linen params of jax_oracles/models/mistral.py, torch-free.

Mistral stores exactly Llama's tensor names, so the table is conversion/llama3.py's.
Checked both ways (conversion/rules.py): every source tensor used by exactly one rule, every param the
Flax model declares (names and shapes from `jax.eval_shape(model.init)`) written.
"""

from __future__ import annotations


from conversion import safetensors_io as st_io
from conversion.llama3 import RULES as LLAMA_RULES
from conversion.rules import apply_rules, invert_rules, declared_shapes
from jax_oracles.models.mistral import MistralConfig, MistralForCausalLM

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]

# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = LLAMA_RULES  # Llama's names exactly (the bias rules match nothing: Mistral has none)


def load_config(path) -> MistralConfig:
    """MistralConfig from an HF checkpoint directory's config.json."""
    return MistralConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: MistralConfig) -> dict[str, tuple[int, ...]]:
    return declared_shapes(MistralForCausalLM(config))


def convert_state_dict(state: dict, config: MistralConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.mistral.MistralForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    A tied head reports nothing (the checkpoint stores only the embedding). Reads no checkpoint file."""
    return invert_rules(params, RULES)
