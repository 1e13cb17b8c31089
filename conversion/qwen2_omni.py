"""HF Qwen2.5-Omni checkpoint (the thinker) -> Flax Linen params of jax_oracles/models/qwen2_omni.py, torch-free.

Every tensor the thinker uses sits under `thinker.`: the language model keeps Qwen2's names (`thinker.model.*`,
llama3's table with its q/k/v biases, and the untied `thinker.lm_head.weight`); the vision tower
(`thinker.visual.*`, separate q/k/v, gated MLP, RMSNorms without bias) and the audio encoder
(`thinker.audio_tower.*`) are renamed one to one: blocks and layers to `blocks_<i>` / `layers_<i>`, Linear
weights to transposed Dense kernels, norms, the Conv3d patch weight and the Conv1d weights kept as stored.
The speech-output modules (`talker.*`, `token2wav.*`, stored when enable_audio_output) are dropped, as
transformers' thinker drops them. Checked both ways (conversion/rules.py) against the params the Flax model
declares through both entry points (an image forward and the audio tower).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from conversion import safetensors_io as st_io
from conversion.llama3 import RULES as LLAMA_RULES
from conversion.rules import apply_rules, invert_rules, keep, linear
from jax_oracles.models.qwen2_omni import Qwen2OmniConfig, Qwen2OmniThinkerForConditionalGeneration

__all__ = ["RULES", "VISION_RULES", "AUDIO_RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]

_V, _A = r"thinker\.visual\.", r"thinker\.audio_tower\."
# Omni's vision tower (`thinker.visual.*`): (HF name regex, "/"-separated param path, transform)
VISION_RULES = [
    (_V + r"patch_embed\.proj\.weight", "visual/patch_embed/weight", keep),
    (_V + r"blocks\.(\d+)\.attn\.(q|k|v|proj)\.weight", "visual/blocks_{0}/attn/{1}/kernel", linear),
    (_V + r"blocks\.(\d+)\.attn\.(q|k|v|proj)\.bias", "visual/blocks_{0}/attn/{1}/bias", keep),
    (_V + r"blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "visual/blocks_{0}/mlp/{1}/kernel", linear),
    (_V + r"blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.bias", "visual/blocks_{0}/mlp/{1}/bias", keep),
    (_V + r"blocks\.(\d+)\.(norm1|norm2)\.weight", "visual/blocks_{0}/{1}/weight", keep),
    (_V + r"merger\.ln_q\.weight", "visual/merger/ln_q/weight", keep),
    (_V + r"merger\.mlp\.(\d)\.weight", "visual/merger/mlp_{0}/kernel", linear),
    (_V + r"merger\.mlp\.(\d)\.bias", "visual/merger/mlp_{0}/bias", keep),
]
# the audio encoder (`thinker.audio_tower.*`)
AUDIO_RULES = [
    (_A + r"(conv1|conv2)\.(weight|bias)", "audio_tower/{0}/{1}", keep),
    (_A + r"audio_bos_eos_token\.weight", "audio_tower/audio_bos_eos_token/embedding", keep),
    (_A + r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight",
     "audio_tower/layers_{0}/self_attn/{1}/kernel", linear),
    (_A + r"layers\.(\d+)\.self_attn\.(q_proj|v_proj|out_proj)\.bias",  # k_proj has no bias
     "audio_tower/layers_{0}/self_attn/{1}/bias", keep),
    (_A + r"layers\.(\d+)\.(fc1|fc2)\.weight", "audio_tower/layers_{0}/{1}/kernel", linear),
    (_A + r"layers\.(\d+)\.(fc1|fc2)\.bias", "audio_tower/layers_{0}/{1}/bias", keep),
    (_A + r"layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.(weight|bias)", "audio_tower/layers_{0}/{1}/{2}",
     keep),
    (_A + r"ln_post\.(weight|bias)", "audio_tower/ln_post/{0}", keep),
    (_A + r"proj\.weight", "audio_tower/proj/kernel", linear),
    (_A + r"proj\.bias", "audio_tower/proj/bias", keep),
]
RULES = [(r"thinker\." + pattern, target, fn) for pattern, target, fn in LLAMA_RULES] + VISION_RULES + AUDIO_RULES


def load_config(path) -> Qwen2OmniConfig:
    """Qwen2OmniConfig from an HF checkpoint directory's config.json (the wrapper's or a bare thinker's)."""
    return Qwen2OmniConfig.from_hf(st_io.load_config(path))


def _declare_all(module, ids, mask, positions, pixels, grid, feats, lens):  # both entry points, for init
    return module(ids, mask, positions, pixels, grid), module.audio_features(feats, lens)


def _expected_shapes(config: Qwen2OmniConfig) -> dict[str, tuple[int, ...]]:
    """Every param the model declares, both towers' too: eval_shape of init on one image of one merged token and
    one audio of three frames."""
    v, a = config.vision, config.audio
    m = v.spatial_merge_size
    pixels = jnp.zeros((m * m, v.in_channels * v.temporal_patch_size * v.patch_size ** 2), jnp.float32)
    ids = jnp.full((1, 1), config.image_token_id, jnp.int32)
    positions = jnp.zeros((3, 1, 1), jnp.int32)
    feats = jnp.zeros((a.num_mel_bins, 3), jnp.float32)
    model = Qwen2OmniThinkerForConditionalGeneration(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids), positions, pixels,
                                               np.array([[1, m, m]]), feats, np.array([3]),
                                               method=_declare_all))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def convert_state_dict(state: dict, config: Qwen2OmniConfig) -> dict:
    """HF-named numpy tensors -> nested Linen `params` dict of f32 jax arrays."""
    state = {k: v for k, v in state.items() if not k.startswith(("talker.", "token2wav."))}
    if config.tie_word_embeddings:
        state.pop("thinker.lm_head.weight", None)  # a tied checkpoint may still store the shared copy
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.qwen2_omni.Qwen2OmniThinkerForConditionalGeneration from an HF
    checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.
    A tied head reports nothing (the checkpoint stores only the embedding). Reads no checkpoint file."""
    return invert_rules(params, RULES)
