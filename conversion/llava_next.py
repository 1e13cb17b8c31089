"""HF LLaVA-NeXT checkpoint -> Flax Linen params of jax_oracles/models/llava_next.py, torch-free.

The table reads the release's names: the Llama language model (conversion/llama3.py's rows) under
`language_model.model.` -> `model/language_model/`, its head `language_model.lm_head.weight` -> `lm_head/kernel`;
the CLIP tower `vision_tower.vision_model.*` -> `model/vision_tower/*` (blocks to `layers_<i>`, Linear weights to
transposed Dense kernels, the Conv2d patch weight, class embedding and norms kept as stored, the position table to
an Embed's `embedding`); `multi_modal_projector.*` and `image_newline` under `model/`. A checkpoint in transformers 5's
other layouts (`model.language_model.*`, `vision_tower.*` without `vision_model.`) is renamed to the release's first
(`release_name`). Checked both ways (conversion/rules.py) against the params the Flax model declares with an image
in its input.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.llama3 import RULES as LLAMA_RULES
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.llava_next import (LlavaNextConfig, LlavaNextForConditionalGeneration, image_num_tiles,
                                          num_image_features)

__all__ = ["RULES", "TEXT_RULES", "VISION_RULES", "release_name", "load_config", "convert_state_dict", "load_params",
           "hf_layout"]


def _under_language_model(rule):
    """A Llama row in the release's LLaVA layout: `model.x` -> `language_model.model.x` (params under
    model/language_model/), `lm_head` -> `language_model.lm_head` (params at the top)."""
    pattern, target, fn = rule
    if pattern.startswith(r"lm_head\."):
        return r"language_model\." + pattern, target, fn
    return (r"language_model\.model\." + pattern[len(r"model\."):],
            "model/language_model/" + target[len("model/"):], fn)


TEXT_RULES = [_under_language_model(rule) for rule in LLAMA_RULES]

# The CLIP tower and the projector: (HF name regex, "/"-separated param path, transform)
_TOWER, _T = r"vision_tower\.vision_model\.", "model/vision_tower/"
_LAYER = _TOWER + r"encoder\.layers\.(\d+)\."
VISION_RULES = [
    (_TOWER + r"embeddings\.class_embedding", _T + "embeddings/class_embedding", keep),
    (_TOWER + r"embeddings\.patch_embedding\.weight", _T + "embeddings/patch_embedding/weight", keep),
    (_TOWER + r"embeddings\.position_embedding\.weight", _T + "embeddings/position_embedding/embedding", keep),
    (_TOWER + r"(pre_layrnorm|post_layernorm)\.(weight|bias)", _T + "{0}/{1}", keep),
    (_LAYER + r"self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight", _T + "encoder/layers_{0}/self_attn/{1}/kernel",
     linear),
    (_LAYER + r"self_attn\.(q_proj|k_proj|v_proj|out_proj)\.bias", _T + "encoder/layers_{0}/self_attn/{1}/bias", keep),
    (_LAYER + r"mlp\.(fc1|fc2)\.weight", _T + "encoder/layers_{0}/mlp/{1}/kernel", linear),
    (_LAYER + r"mlp\.(fc1|fc2)\.bias", _T + "encoder/layers_{0}/mlp/{1}/bias", keep),
    (_LAYER + r"(layer_norm1|layer_norm2)\.(weight|bias)", _T + "encoder/layers_{0}/{1}/{2}", keep),
    (r"multi_modal_projector\.(linear_1|linear_2)\.weight", "model/multi_modal_projector/{0}/kernel", linear),
    (r"multi_modal_projector\.(linear_1|linear_2)\.bias", "model/multi_modal_projector/{0}/bias", keep),
    (r"image_newline", "model/image_newline", keep),
]
RULES = TEXT_RULES + VISION_RULES

# transformers 5's own layouts -> the release's (save_original_format=False, or its default save without the
# CLIPVisionModel prefix)
_RELEASE_PREFIXES = [(r"model\.language_model\.", "language_model.model."),
                     (r"model\.(vision_tower|multi_modal_projector|image_newline)", r"\1"),
                     (r"lm_head\.", "language_model.lm_head.")]


def release_name(name: str) -> str:
    for prefix, target in _RELEASE_PREFIXES:
        if re.match(prefix, name):
            name = re.sub("^" + prefix, target, name)
            break
    return re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", name)


def load_config(path) -> LlavaNextConfig:
    """LlavaNextConfig from an HF checkpoint directory's config.json."""
    return LlavaNextConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: LlavaNextConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares, the tower's and the projector's too: eval_shape of init on one square image
    (its tiles) and its image tokens."""
    v = config.vision
    size = np.array([[v.image_size, v.image_size]])
    pixels = jnp.zeros((1, image_num_tiles(tuple(size[0]), config), v.num_channels, v.image_size, v.image_size))
    ids = jnp.full((1, num_image_features(tuple(size[0]), config)), config.image_token_id, jnp.int32)
    model = LlavaNextForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), pixels, size))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: LlavaNextConfig) -> dict:
    """HF-named numpy tensors (any of the layouts) -> nested Linen `params` dict of f32 jax arrays."""
    state = {release_name(k): v for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("language_model.lm_head.weight", None)  # a tied checkpoint may still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.llava_next.LlavaNextForConditionalGeneration from an HF checkpoint
    dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name (the release's): HF shape} each leaf of a converted `params` tree came from: RULES run
    backwards. A tied head reports nothing. Reads no checkpoint file."""
    return invert_rules(params, RULES)
