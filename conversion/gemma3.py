"""HF Gemma 3 (multimodal) checkpoint -> Flax Linen params of jax_oracles/models/gemma3.py, torch-free.

The release stores the LLaVA layout: `language_model.model.*` (the Gemma 3 decoder, tied: no head),
`vision_tower.vision_model.*` (SigLIP) and `multi_modal_projector.{mm_input_projection_weight, mm_soft_emb_norm}`;
the params are named like the torch module tree. The decoder and tower rows are conversion/gemma_rules.py's (the
Gemma rows cover Gemma 3's q/k norms and sandwich norms); the projection weight is stored [in, out] and kept, as
every norm and table. transformers 5's save (`vision_tower.*` without `vision_model.`) is read too. Checked both
ways (conversion/rules.py) against the params the Flax model declares with an image in its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.gemma_rules import GEMMA_RULES, SIGLIP_RULES, release_names
from conversion.rules import apply_rules, invert_rules, keep
from jax_oracles.models.gemma3 import Gemma3Config, Gemma3ForConditionalGeneration

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]

RULES = GEMMA_RULES + SIGLIP_RULES + [
    (r"multi_modal_projector\.mm_input_projection_weight", "model/multi_modal_projector/mm_input_projection_weight",
     keep),
    (r"multi_modal_projector\.mm_soft_emb_norm\.weight", "model/multi_modal_projector/mm_soft_emb_norm/weight", keep),
]


def load_config(path) -> Gemma3Config:
    """Gemma3Config from an HF checkpoint directory's config.json."""
    return Gemma3Config.from_hf(st_io.load_config(path))


def _expected_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every param the model declares: eval_shape of init on one image and its image tokens."""
    v = config.vision
    pixels = jnp.zeros((1, v.num_channels, v.image_size, v.image_size), jnp.float32)
    ids = jnp.full((1, config.mm_tokens_per_image), config.image_token_id, jnp.int32)
    model = Gemma3ForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), pixels))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: Gemma3Config) -> dict:
    """HF-named numpy tensors (the release's names or transformers 5's save) -> nested Linen `params` of f32."""
    state = release_names(state)
    if config.tie_word_embeddings:
        state.pop("language_model.lm_head.weight", None)  # a tied checkpoint may still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` for jax_oracles.models.gemma3.Gemma3ForConditionalGeneration from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name (the release's): HF shape} each leaf of a converted `params` tree came from: RULES run
    backwards. A tied head reports nothing. Reads no checkpoint file."""
    return invert_rules(params, RULES)
