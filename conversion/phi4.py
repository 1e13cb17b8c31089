"""HF Phi-4 (model_type "phi3") checkpoint -> Flax Linen params of jax_oracles/models/phi4.py, torch-free.

One declarative table, checked both ways (conversion/rules.py). The fused `qkv_proj` and `gate_up_proj`
stay fused: the model splits their outputs, so the kernels are only transposed.
"""

from __future__ import annotations

import numpy as np

from conversion import safetensors_io as st_io
from conversion.rules import apply_rules, invert_rules, declared_shapes, keep as _keep, linear as _linear
from jax_oracles.models.phi4 import Phi3Config, Phi3ForCausalLM

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


ATTN, MLP = "(qkv_proj|o_proj)", "(gate_up_proj|down_proj)"
NORMS = "(input_layernorm|post_attention_layernorm)"
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"model\.embed_tokens\.weight", "model/embed_tokens/embedding", _keep),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.weight", "model/layers_{0}/self_attn/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.mlp\.{MLP}\.weight", "model/layers_{0}/mlp/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.{NORMS}\.weight", "model/layers_{0}/{1}/weight", _keep),
    (r"model\.norm\.weight", "model/norm/weight", _keep),
    (r"lm_head\.weight", "lm_head/kernel", _linear),
]


def load_config(path) -> Phi3Config:
    """Phi3Config from an HF checkpoint directory's config.json."""
    return Phi3Config.from_hf(st_io.load_config(path))


def _expected_shapes(config: Phi3Config) -> dict[str, tuple[int, ...]]:
    return declared_shapes(Phi3ForCausalLM(config))


def convert_state_dict(state: dict[str, np.ndarray], config: Phi3Config) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a tied copy may still store the shared head
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.phi4.Phi3ForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards."""
    return invert_rules(params, RULES)
