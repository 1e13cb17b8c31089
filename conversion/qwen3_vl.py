"""HF Qwen3-VL checkpoint -> Flax Linen params of jax_oracles/models/qwen3_vl.py, torch-free.

The language model keeps Qwen3's names (conversion/qwen3.py's table: llama3's plus q_norm / k_norm) under
`model.language_model.` / `model/language_model/`; the tower (`model.visual.*`) is renamed one to one: blocks and
deepstack mergers to `blocks_<i>` / `deepstack_merger_list_<j>`, Linear weights to transposed Dense kernels, norms,
the position table and the Conv3d patch weight and bias kept as stored (the JAX PatchEmbed reads the checkpoint's
[E, C, T, ps, ps] layout). Checked both ways (conversion/rules.py) against the params the Flax model declares with
an image in its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.qwen3 import RULES as QWEN3_RULES
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.qwen3_vl import Qwen3VLConfig, Qwen3VLForConditionalGeneration

__all__ = ["RULES", "TEXT_RULES", "VISION_RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


def _under_language_model(rule):
    """A Qwen3 row moved under the VL wrapper: `model.x` -> `model.language_model.x` (lm_head stays put)."""
    pattern, target, fn = rule
    if not pattern.startswith(r"model\."):
        return rule
    return (r"model\.language_model\." + pattern[len(r"model\."):],
            "model/language_model/" + target[len("model/"):], fn)


TEXT_RULES = [_under_language_model(rule) for rule in QWEN3_RULES]

# The Qwen3-VL tower (`model.visual.*`): (HF name regex, "/"-separated param path, transform)
_VISUAL = r"model\.visual\."
VISION_RULES = [
    (_VISUAL + r"patch_embed\.proj\.(weight|bias)", "model/visual/patch_embed/{0}", keep),
    (_VISUAL + r"pos_embed\.weight", "model/visual/pos_embed/embedding", keep),
    (_VISUAL + r"blocks\.(\d+)\.attn\.(qkv|proj)\.weight", "model/visual/blocks_{0}/attn/{1}/kernel", linear),
    (_VISUAL + r"blocks\.(\d+)\.attn\.(qkv|proj)\.bias", "model/visual/blocks_{0}/attn/{1}/bias", keep),
    (_VISUAL + r"blocks\.(\d+)\.mlp\.(linear_fc1|linear_fc2)\.weight", "model/visual/blocks_{0}/mlp/{1}/kernel",
     linear),
    (_VISUAL + r"blocks\.(\d+)\.mlp\.(linear_fc1|linear_fc2)\.bias", "model/visual/blocks_{0}/mlp/{1}/bias", keep),
    (_VISUAL + r"blocks\.(\d+)\.(norm1|norm2)\.(weight|bias)", "model/visual/blocks_{0}/{1}/{2}", keep),
    (_VISUAL + r"merger\.norm\.(weight|bias)", "model/visual/merger/norm/{0}", keep),
    (_VISUAL + r"merger\.(linear_fc1|linear_fc2)\.weight", "model/visual/merger/{0}/kernel", linear),
    (_VISUAL + r"merger\.(linear_fc1|linear_fc2)\.bias", "model/visual/merger/{0}/bias", keep),
    (_VISUAL + r"deepstack_merger_list\.(\d+)\.norm\.(weight|bias)", "model/visual/deepstack_merger_list_{0}/norm/{1}",
     keep),
    (_VISUAL + r"deepstack_merger_list\.(\d+)\.(linear_fc1|linear_fc2)\.weight",
     "model/visual/deepstack_merger_list_{0}/{1}/kernel", linear),
    (_VISUAL + r"deepstack_merger_list\.(\d+)\.(linear_fc1|linear_fc2)\.bias",
     "model/visual/deepstack_merger_list_{0}/{1}/bias", keep),
]
RULES = TEXT_RULES + VISION_RULES


def load_config(path) -> Qwen3VLConfig:
    """Qwen3VLConfig from an HF checkpoint directory's config.json."""
    return Qwen3VLConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: Qwen3VLConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares, the tower's and its deepstack mergers' too: eval_shape of init on one image
    of one merged token."""
    v = config.vision
    m = v.spatial_merge_size
    pixels = jnp.zeros((m * m, v.in_channels * v.temporal_patch_size * v.patch_size ** 2), jnp.float32)
    ids = jnp.full((1, 1), config.image_token_id, jnp.int32)
    positions = jnp.zeros((3, 1, 1), jnp.int32)
    model = Qwen3VLForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), positions, pixels,
                                               np.array([[1, m, m]])))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: Qwen3VLConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.qwen3_vl.Qwen3VLForConditionalGeneration from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    A tied head reports nothing (the checkpoint stores only the embedding). Reads no checkpoint file."""
    return invert_rules(params, RULES)
