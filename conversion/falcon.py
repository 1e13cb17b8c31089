"""HF Falcon checkpoint -> Flax Linen params of jax_oracles/models/falcon.py, torch-free.

One declarative table maps every HF tensor name to a param path; the fused `query_key_value` is kept
fused (the model splits it, `split_qkv`). Checked both ways: every source tensor must be used by exactly
one rule, and every param the Flax model declares (from `jax.eval_shape(model.init)`) must be written,
so a checkpoint of the other layout (input_layernorm vs ln_attn/ln_mlp) is refused.
"""

from __future__ import annotations

import numpy as np

from conversion import safetensors_io as st_io
from conversion.rules import apply_rules, invert_rules, declared_shapes, keep as _keep, linear as _linear
from jax_oracles.models.falcon import FalconConfig, FalconForCausalLM

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


LAYER = r"transformer\.h\.(\d+)"
ATTN, MLP = "(query_key_value|dense)", "(dense_h_to_4h|dense_4h_to_h)"
NORMS = "(input_layernorm|ln_attn|ln_mlp)"
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"transformer\.word_embeddings\.weight", "transformer/word_embeddings/embedding", _keep),
    (rf"{LAYER}\.self_attention\.{ATTN}\.weight", "transformer/h_{0}/self_attention/{1}/kernel", _linear),
    (rf"{LAYER}\.self_attention\.{ATTN}\.bias", "transformer/h_{0}/self_attention/{1}/bias", _keep),
    (rf"{LAYER}\.mlp\.{MLP}\.weight", "transformer/h_{0}/mlp/{1}/kernel", _linear),
    (rf"{LAYER}\.mlp\.{MLP}\.bias", "transformer/h_{0}/mlp/{1}/bias", _keep),
    (rf"{LAYER}\.{NORMS}\.(weight|bias)", "transformer/h_{0}/{1}/{2}", _keep),
    (r"transformer\.ln_f\.(weight|bias)", "transformer/ln_f/{0}", _keep),
    (r"lm_head\.weight", "lm_head/kernel", _linear),
]


def load_config(path) -> FalconConfig:
    """FalconConfig from an HF checkpoint directory's config.json."""
    return FalconConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: FalconConfig) -> dict[str, tuple[int, ...]]:
    return declared_shapes(FalconForCausalLM(config))


def convert_state_dict(state: dict[str, np.ndarray], config: FalconConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a tied save may still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.falcon.FalconForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    Kernels report the checkpoint's [out, in]; the tied head reports nothing. Reads no checkpoint file."""
    return invert_rules(params, RULES)
