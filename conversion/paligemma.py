"""HF PaliGemma checkpoint -> Flax Linen params of jax_oracles/models/paligemma.py, torch-free.

The release stores the LLaVA layout: `language_model.model.*` (the Gemma decoder; `language_model.lm_head.weight`
only when untied), `vision_tower.vision_model.*` (SigLIP) and `multi_modal_projector.linear.*`; the params are
named like the torch module tree (`model/language_model/layers_<i>/...`, `model/vision_tower/...`,
`model/multi_modal_projector/linear`). Linear weights become transposed Dense kernels; norms, the embedding
tables and the Conv2d patch weight [E, C, p, p] are kept as stored. transformers 5's save_pretrained drops the
tower's `vision_model.` (it writes `vision_tower.*`): such a checkpoint is read too, under the release's names.
The Gemma decoder and SigLIP rows are conversion/gemma_rules.py's, shared with conversion/gemma3.py. Checked both ways (conversion/rules.py)
against the params the Flax model declares with an image in its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.gemma_rules import GEMMA_RULES, SIGLIP_RULES, release_names
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.paligemma import PaliGemmaConfig, PaliGemmaForConditionalGeneration

__all__ = ["RULES", "GEMMA_RULES", "SIGLIP_RULES", "release_names", "load_config", "convert_state_dict",
           "load_params", "hf_layout"]

RULES = GEMMA_RULES + SIGLIP_RULES + [
    (r"multi_modal_projector\.linear\.weight", "model/multi_modal_projector/linear/kernel", linear),
    (r"multi_modal_projector\.linear\.bias", "model/multi_modal_projector/linear/bias", keep),
]


def load_config(path) -> PaliGemmaConfig:
    """PaliGemmaConfig from an HF checkpoint directory's config.json."""
    return PaliGemmaConfig.from_hf(st_io.load_config(path))


def _expected_shapes(config: PaliGemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares: eval_shape of init on one image and its image tokens."""
    v = config.vision
    pixels = jnp.zeros((1, v.num_channels, v.image_size, v.image_size), jnp.float32)
    ids = jnp.full((1, v.num_patches), config.image_token_id, jnp.int32)
    model = PaliGemmaForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), pixels))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: PaliGemmaConfig) -> dict:
    """HF-named numpy tensors (the release's names or transformers 5's save) -> nested Linen `params` of f32."""
    state = release_names(state)
    if config.tie_word_embeddings:
        state.pop("language_model.lm_head.weight", None)  # a tied checkpoint may still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` for jax_oracles.models.paligemma.PaliGemmaForConditionalGeneration from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name (the release's): HF shape} each leaf of a converted `params` tree came from: RULES run
    backwards. A tied head reports nothing. Reads no checkpoint file."""
    return invert_rules(params, RULES)
