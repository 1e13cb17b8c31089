"""HF Qwen2.5-VL checkpoint -> Flax Linen params of jax_oracles/models/qwen2_5_vl.py, torch-free.

The language model keeps Qwen2's names (`model.*`, llama3's table with its q/k/v biases, and `lm_head.weight` when
untied, as the 7B release stores it); the tower (`visual.*`) is renamed one to one: blocks to `blocks_<i>`, Linear
weights (the fused `attn.qkv`, `attn.proj`, the biased gate/up/down projections, the merger's MLP) to transposed
Dense kernels, the RMSNorm weights and the Conv3d patch weight kept as stored (the JAX PatchEmbed reads the
checkpoint's [E, C, T, ps, ps] layout). Checked both ways (conversion/rules.py) against the params the Flax model
declares with an image in its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.llama3 import RULES as LLAMA_RULES
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.qwen2_5_vl import Qwen2_5VLConfig, Qwen2_5VLForConditionalGeneration

__all__ = ["RULES", "VISION_RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]

# The Qwen2.5-VL tower (`visual.*`): (HF name regex, "/"-separated param path, transform)
VISION_RULES = [
    (r"visual\.patch_embed\.proj\.weight", "visual/patch_embed/weight", keep),
    (r"visual\.blocks\.(\d+)\.attn\.(qkv|proj)\.weight", "visual/blocks_{0}/attn/{1}/kernel", linear),
    (r"visual\.blocks\.(\d+)\.attn\.(qkv|proj)\.bias", "visual/blocks_{0}/attn/{1}/bias", keep),
    (r"visual\.blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "visual/blocks_{0}/mlp/{1}/kernel", linear),
    (r"visual\.blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.bias", "visual/blocks_{0}/mlp/{1}/bias", keep),
    (r"visual\.blocks\.(\d+)\.(norm1|norm2)\.weight", "visual/blocks_{0}/{1}/weight", keep),
    (r"visual\.merger\.ln_q\.weight", "visual/merger/ln_q/weight", keep),
    (r"visual\.merger\.mlp\.(\d)\.weight", "visual/merger/mlp_{0}/kernel", linear),
    (r"visual\.merger\.mlp\.(\d)\.bias", "visual/merger/mlp_{0}/bias", keep),
]
RULES = LLAMA_RULES + VISION_RULES


def load_config(path) -> Qwen2_5VLConfig:
    """Qwen2_5VLConfig from an HF checkpoint directory's config.json."""
    return Qwen2_5VLConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: Qwen2_5VLConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares, the tower's too: eval_shape of init on one image of one merged token."""
    v = config.vision
    m = v.spatial_merge_size
    pixels = jnp.zeros((m * m, v.in_channels * v.temporal_patch_size * v.patch_size ** 2), jnp.float32)
    ids = jnp.full((1, 1), config.image_token_id, jnp.int32)
    positions = jnp.zeros((3, 1, 1), jnp.int32)
    model = Qwen2_5VLForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), positions, pixels,
                                               np.array([[1, m, m]])))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: Qwen2_5VLConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.qwen2_5_vl.Qwen2_5VLForConditionalGeneration from an HF
    checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    A tied head reports nothing (the checkpoint stores only the embedding). Reads no checkpoint file."""
    return invert_rules(params, RULES)
