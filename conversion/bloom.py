"""HF BLOOM checkpoint -> Flax Linen params of jax_oracles/models/bloom.py, torch-free.

One declarative table maps every HF tensor name to a param path, checked both ways (conversion/rules.py).
The fused `query_key_value` keeps its per-head interleaved row order: the model splits it
(jax_oracles/models/bloom.py: split_qkv), so the converter only transposes. The head is tied: a
stored `lm_head.weight` (the shared copy) is dropped.
"""

from __future__ import annotations

import numpy as np

from conversion import safetensors_io as st_io
from conversion.rules import apply_rules, invert_rules, declared_shapes, keep as _keep, linear as _linear
from jax_oracles.models.bloom import BloomConfig, BloomForCausalLM

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


LAYER = r"transformer\.h\.(\d+)"
NORMS = r"(input_layernorm|post_attention_layernorm)"
PARAM = r"(weight|bias)"
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"transformer\.word_embeddings\.weight", "transformer/word_embeddings/embedding", _keep),
    (rf"transformer\.(word_embeddings_layernorm|ln_f)\.{PARAM}", "transformer/{0}/{1}", _keep),
    (rf"{LAYER}\.{NORMS}\.{PARAM}", "transformer/h_{0}/{1}/{2}", _keep),
    (rf"{LAYER}\.self_attention\.(query_key_value|dense)\.weight", "transformer/h_{0}/self_attention/{1}/kernel",
     _linear),
    (rf"{LAYER}\.self_attention\.(query_key_value|dense)\.bias", "transformer/h_{0}/self_attention/{1}/bias", _keep),
    (rf"{LAYER}\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.weight", "transformer/h_{0}/mlp/{1}/kernel", _linear),
    (rf"{LAYER}\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.bias", "transformer/h_{0}/mlp/{1}/bias", _keep),
]


def load_config(path) -> BloomConfig:
    """BloomConfig from an HF checkpoint directory's config.json."""
    return BloomConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: BloomConfig) -> dict[str, tuple[int, ...]]:
    return declared_shapes(BloomForCausalLM(config))


def convert_state_dict(state: dict[str, np.ndarray], config: BloomConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    state.pop("lm_head.weight", None)  # tied; some saves still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.bloom.BloomForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.

    Kernels report the checkpoint's [out, in]; the tied head reports nothing (the release stores only
    the embedding). Reads no checkpoint file.
    """
    return invert_rules(params, RULES)
