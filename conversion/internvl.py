"""HF InternVL checkpoint -> Flax Linen params of jax_oracles/models/internvl.py, torch-free.

The rows read the release's stored names: the Qwen2 language model under `language_model.` (conversion/qwen2.py's
table, moved to `model/language_model/` and `lm_head`), the tower `vision_tower.*` and the projector
`multi_modal_projector.*` renamed one to one under `model/` (encoder layers to `layer_<i>`, Linear weights to
transposed Dense kernels; norms, lambdas, CLS token, position table and the Conv2d patch weight [E,C,p,p] kept as
stored). A checkpoint saved with transformers 5's in-memory names (`save_original_format=False`) is renamed to the
stored ones first. Checked both ways (conversion/rules.py) against the params the Flax model declares with an image
in its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.qwen2 import RULES as QWEN2_RULES
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.internvl import InternVLConfig, InternVLForConditionalGeneration

__all__ = ["RULES", "TEXT_RULES", "VISION_RULES", "stored_name", "load_config", "convert_state_dict", "load_params",
           "hf_layout"]


def _under_language_model(rule):
    """A Qwen2 row moved under the wrapper: `model.x` -> stored `language_model.model.x`, param
    `model/language_model/x`; `lm_head.weight` -> stored `language_model.lm_head.weight`, param `lm_head`."""
    pattern, target, fn = rule
    if pattern.startswith(r"model\."):
        return r"language_model\." + pattern, "model/language_model/" + target[len("model/"):], fn
    return r"language_model\." + pattern, target, fn


TEXT_RULES = [_under_language_model(rule) for rule in QWEN2_RULES]

_V, _L = r"vision_tower\.", r"vision_tower\.encoder\.layer\.(\d+)\."
_P = r"multi_modal_projector\."
VISION_RULES = [
    (_V + r"embeddings\.(cls_token|position_embeddings)", "model/vision_tower/embeddings/{0}", keep),
    (_V + r"embeddings\.patch_embeddings\.projection\.(weight|bias)",
     "model/vision_tower/embeddings/patch_embeddings/projection/{0}", keep),
    (_L + r"attention\.(q_proj|k_proj|v_proj|projection_layer)\.weight",
     "model/vision_tower/encoder/layer_{0}/attention/{1}/kernel", linear),
    (_L + r"attention\.(q_proj|k_proj|v_proj|projection_layer)\.bias",
     "model/vision_tower/encoder/layer_{0}/attention/{1}/bias", keep),
    (_L + r"attention\.(q_norm|k_norm)\.weight", "model/vision_tower/encoder/layer_{0}/attention/{1}/weight", keep),
    (_L + r"mlp\.(fc1|fc2)\.weight", "model/vision_tower/encoder/layer_{0}/mlp/{1}/kernel", linear),
    (_L + r"mlp\.(fc1|fc2)\.bias", "model/vision_tower/encoder/layer_{0}/mlp/{1}/bias", keep),
    (_L + r"(layernorm_before|layernorm_after)\.(weight|bias)", "model/vision_tower/encoder/layer_{0}/{1}/{2}", keep),
    (_L + r"(lambda_1|lambda_2)", "model/vision_tower/encoder/layer_{0}/{1}", keep),
    (_V + r"layernorm\.(weight|bias)", "model/vision_tower/layernorm/{0}", keep),
    (_P + r"layer_norm\.(weight|bias)", "model/multi_modal_projector/layer_norm/{0}", keep),
    (_P + r"(linear_1|linear_2)\.weight", "model/multi_modal_projector/{0}/kernel", linear),
    (_P + r"(linear_1|linear_2)\.bias", "model/multi_modal_projector/{0}/bias", keep),
]
RULES = TEXT_RULES + VISION_RULES


def stored_name(name: str) -> str:
    """transformers 5's in-memory name -> the release's stored one (stored names pass unchanged)."""
    for live, saved in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                        ("model.vision_tower.", "vision_tower."),
                        ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(live):
            return saved + name[len(live):]
    return name


def load_config(path) -> InternVLConfig:
    """InternVLConfig from an HF checkpoint directory: config.json, untied where it ties the head but the checkpoint
    stores a different one (transformers keeps both then; its save_pretrained writes such a pair)."""
    config = InternVLConfig.from_hf(st_io.load_config(path))
    if config.tie_word_embeddings and _stores_own_head(st_io.load_state_dict(path)):
        return config.untied()
    return config


def _stores_own_head(state: dict) -> bool:
    state = {stored_name(name): w for name, w in state.items()}
    head = state.get("language_model.lm_head.weight")
    return head is not None and not np.array_equal(head, state["language_model.model.embed_tokens.weight"])


def _expected_shapes(config: InternVLConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares, the tower's and projector's too: eval_shape of init on one tile."""
    v = config.vision
    pixels = jnp.zeros((1, v.num_channels, *v.image_size), jnp.float32)
    ids = jnp.full((1, config.tokens_per_tile), config.image_token_id, jnp.int32)
    model = InternVLForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), pixels))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: InternVLConfig) -> dict:
    """HF-named numpy tensors (stored or in-memory names) -> nested Linen `params` dict of f32 jax arrays."""
    if config.tie_word_embeddings and _stores_own_head(state):
        raise ValueError("config ties the head but the checkpoint stores a different one (load_config unties it)")
    state = {stored_name(name): w for name, w in state.items()}
    if config.tie_word_embeddings:
        state.pop("language_model.lm_head.weight", None)  # some tied checkpoints still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.internvl.InternVLForConditionalGeneration from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{stored HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    A tied head reports nothing (the checkpoint stores only the embedding). Reads no checkpoint file."""
    return invert_rules(params, RULES)
