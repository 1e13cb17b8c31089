"""HF Gemma 4 checkpoint -> Flax Linen params of jax_oracles/models/gemma4.py, torch-free.

Reads a text-only `gemma4_text` checkpoint or a release's multimodal one
(Gemma4ForConditionalGeneration): there the language model sits under `model.language_model.*`,
which `_text_state` renames to the text model's `model.*`, and the vision / audio towers
(`SKIPPED_TOWERS`) are dropped on purpose; any other prefix fails.

One declarative table maps every HF tensor name to a param path. The conversion is checked
both ways: every source tensor must be used by exactly one rule (or be one of the k/v tensors
that KV-shared layers ignore, see `_ignored`), and every param the Flax model declares
(names and shapes from `jax.eval_shape(model.init)`) must be written.
"""

from __future__ import annotations

import re

import numpy as np

from conversion import safetensors_io as st_io
from conversion.rules import apply_rules, invert_rules, declared_shapes, keep as _keep, linear as _linear
from jax_oracles.models.gemma4 import LANGUAGE_MODEL, SKIPPED_TOWERS, Gemma4ForCausalLM, Gemma4TextConfig

__all__ = ["RULES", "load_config", "convert_state_dict", "load_params", "hf_layout"]


ATTN, MLP = "(q_proj|k_proj|v_proj|o_proj)", "(gate_proj|up_proj|down_proj)"
NORMS = ("(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
         "|post_per_layer_input_norm)")
PLE = "(per_layer_input_gate|per_layer_projection)"
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"model\.embed_tokens\.weight", "model/embed_tokens/embedding", _keep),
    (r"model\.embed_tokens_per_layer\.weight", "model/embed_tokens_per_layer/embedding", _keep),
    (r"model\.per_layer_model_projection\.weight", "model/per_layer_model_projection/kernel", _linear),
    (r"model\.per_layer_projection_norm\.weight", "model/per_layer_projection_norm/weight", _keep),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.weight", "model/layers_{0}/self_attn/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.bias", "model/layers_{0}/self_attn/{1}/bias", _keep),
    (r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight", "model/layers_{0}/self_attn/{1}/weight", _keep),
    (rf"model\.layers\.(\d+)\.mlp\.{MLP}\.weight", "model/layers_{0}/mlp/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.{NORMS}\.weight", "model/layers_{0}/{1}/weight", _keep),
    (rf"model\.layers\.(\d+)\.{PLE}\.weight", "model/layers_{0}/{1}/kernel", _linear),
    (r"model\.layers\.(\d+)\.layer_scalar", "model/layers_{0}/layer_scalar", _keep),
    (r"model\.norm\.weight", "model/norm/weight", _keep),
    (r"lm_head\.weight", "lm_head/kernel", _linear),
]


def load_config(path) -> Gemma4TextConfig:
    """Gemma4TextConfig from an HF checkpoint directory's config.json."""
    return Gemma4TextConfig.from_hf(st_io.load_config(path))


def _ignored(config: Gemma4TextConfig, name: str) -> bool:
    # Released checkpoints may still carry k/v weights on KV-shared layers (transformers drops
    # them via _keys_to_ignore_on_load_unexpected); so may a tied one carry lm_head.
    if name == "lm_head.weight":
        return config.tie_word_embeddings
    m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.\w+", name)
    return m is not None and config.is_kv_shared(int(m.group(1)))


def _expected_shapes(config: Gemma4TextConfig) -> dict[str, tuple[int, ...]]:
    return declared_shapes(Gemma4ForCausalLM(config), with_mask=False)


def _text_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The language model's tensors under the text model's names; the release's towers are skipped."""
    out = {}
    for name, w in state.items():
        if name.startswith(SKIPPED_TOWERS):
            continue
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name[len(LANGUAGE_MODEL):]
        elif not name.startswith("model.") and name != "lm_head.weight":
            raise ValueError(f"Gemma 4 checkpoint: tensor {name!r} belongs to no known part")
        out[name] = w
    return out


def convert_state_dict(state: dict[str, np.ndarray], config: Gemma4TextConfig) -> dict:
    """HF-named numpy tensors (text-only or release layout) -> nested Linen `params` dict of f32 jax arrays."""
    state = {k: v for k, v in _text_state(state).items() if not _ignored(config, k)}
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.gemma4.Gemma4ForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params, release: bool = False) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards.

    Kernels report the checkpoint's [out, in]; the tied head and the k/v of KV-shared layers, which
    the model does not declare, report nothing (what the release stores). Reads no checkpoint file.
    release=True names them as the multimodal release stores them (`model.language_model.*`).
    """
    layout = invert_rules(params, RULES)
    if not release:
        return layout
    return {LANGUAGE_MODEL + k[len("model."):] if k.startswith("model.") else k: v for k, v in layout.items()}
