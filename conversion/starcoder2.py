"""HF StarCoder2 checkpoint -> Flax Linen params of jax_oracles/models/starcoder2.py, torch-free.

One declarative table, checked both ways (conversion/rules.py): every projection has a weight and a
bias, every LayerNorm a weight and a bias; the head is tied to the embedding, so the release stores
no `lm_head.weight` (an untied copy converts it).
"""

from __future__ import annotations

import numpy as np

from conversion import safetensors_io as st_io
from conversion.rules import apply_rules, invert_rules, declared_shapes, keep as _keep, linear as _linear
from jax_oracles.models.starcoder2 import Starcoder2Config, Starcoder2ForCausalLM

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


ATTN, MLP = "(q_proj|k_proj|v_proj|o_proj)", "(c_fc|c_proj)"
NORMS = "(input_layernorm|post_attention_layernorm)"
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"model\.embed_tokens\.weight", "model/embed_tokens/embedding", _keep),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.weight", "model/layers_{0}/self_attn/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.bias", "model/layers_{0}/self_attn/{1}/bias", _keep),
    (rf"model\.layers\.(\d+)\.mlp\.{MLP}\.weight", "model/layers_{0}/mlp/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.mlp\.{MLP}\.bias", "model/layers_{0}/mlp/{1}/bias", _keep),
    (rf"model\.layers\.(\d+)\.{NORMS}\.(weight|bias)", "model/layers_{0}/{1}/{2}", _keep),
    (r"model\.norm\.(weight|bias)", "model/norm/{0}", _keep),
    (r"lm_head\.weight", "lm_head/kernel", _linear),
]


def load_config(path) -> Starcoder2Config:
    """Starcoder2Config from an HF checkpoint directory's config.json."""
    return Starcoder2Config.from_hf(st_io.load_config(path))


def _expected_shapes(config: Starcoder2Config) -> dict[str, tuple[int, ...]]:
    return declared_shapes(Starcoder2ForCausalLM(config))


def convert_state_dict(state: dict[str, np.ndarray], config: Starcoder2Config) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.starcoder2.Starcoder2ForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    The tied head reports nothing (the release stores only the embedding)."""
    return invert_rules(params, RULES)
