"""HF GPT-OSS checkpoint -> Flax Linen params of jax_oracles/models/gpt_oss.py, torch-free.

The release stores each expert matrix as an MXFP4 pair, `<w>_blocks` u8[E, out, in/32, 16] and
`<w>_scales` u8[E, out, in/32]. `dequantize_pairs` replaces every pair by `<w>` f32 in HF's dequantized
layout [E, in, out] (x @ W: gate_up_proj [E,D,2I], down_proj [E,I,D]), which is also the param layout;
then the declarative table applies, checked both ways (conversion/rules.py): every source tensor used
(a pair by the dequantization, which fails on an unpaired half, its result by a rule), every param the
Flax model declares written. A checkpoint saved already dequantized (plain `<w>`) converts the same way.
"""

from __future__ import annotations

import re

import numpy as np

from conversion import safetensors_io as st_io
from conversion.mxfp4 import dequantize_mxfp4
from conversion.rules import apply_rules, declared_shapes, invert_rules, keep as _keep, linear as _linear
from jax_oracles.models.gpt_oss import GptOssConfig, GptOssForCausalLM

__all__ = ["RULES", "load_config", "dequantize_pairs", "convert_state_dict", "load_params", "hf_layout",
           "dequantize_mxfp4"]

ATTN, NORMS = "(q_proj|k_proj|v_proj|o_proj)", "(input_layernorm|post_attention_layernorm)"
EXPERTS = "(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)"
QUANTIZED = r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"  # stored as MXFP4 pairs
# (HF name regex, "/"-separated param path formatted with the regex groups, transform)
RULES = [
    (r"model\.embed_tokens\.weight", "model/embed_tokens/embedding", _keep),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.weight", "model/layers_{0}/self_attn/{1}/kernel", _linear),
    (rf"model\.layers\.(\d+)\.self_attn\.{ATTN}\.bias", "model/layers_{0}/self_attn/{1}/bias", _keep),
    (r"model\.layers\.(\d+)\.self_attn\.sinks", "model/layers_{0}/self_attn/sinks", _keep),
    (r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)", "model/layers_{0}/mlp/router/{1}", _keep),  # [E,D] as HF
    (rf"model\.layers\.(\d+)\.mlp\.experts\.{EXPERTS}", "model/layers_{0}/mlp/experts/{1}", _keep),  # dequantized
    (rf"model\.layers\.(\d+)\.{NORMS}\.weight", "model/layers_{0}/{1}/weight", _keep),
    (r"model\.norm\.weight", "model/norm/weight", _keep),
    (r"lm_head\.weight", "lm_head/kernel", _linear),
]


def load_config(path) -> GptOssConfig:
    """GptOssConfig from an HF checkpoint directory's config.json."""
    return GptOssConfig.from_hf(st_io.load_config(path))


def dequantize_pairs(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each `<w>_blocks` + `<w>_scales` pair -> `<w>` f32 [E, in, out] (the MXFP4 [E, out, in] transposed);
    every other tensor passes through. Raises on a half without its other half."""
    state = dict(state)
    halves = {n.rsplit("_", 1)[0] for n in state if n.endswith(("_blocks", "_scales"))}
    for base in sorted(halves):
        missing = [n for n in (base + "_blocks", base + "_scales") if n not in state]
        if missing:
            raise ValueError(f"MXFP4 tensor {base}: {missing} missing from the checkpoint")
        w = dequantize_mxfp4(state.pop(base + "_blocks"), state.pop(base + "_scales"))  # f32[E, out, in]
        state[base] = np.ascontiguousarray(np.swapaxes(w, -1, -2))
    return state


def _expected_shapes(config: GptOssConfig) -> dict[str, tuple[int, ...]]:
    return declared_shapes(GptOssForCausalLM(config))


def convert_state_dict(state: dict[str, np.ndarray], config: GptOssConfig) -> dict:
    """HF-named numpy tensors (MXFP4 pairs or dequantized experts) -> nested Linen `params` of f32 jax arrays."""
    state = dequantize_pairs(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a tied head reads the embedding
    return apply_rules(state, RULES, _expected_shapes(config))


def load_params(path) -> dict:
    """Linen `params` tree for jax_oracles.models.gpt_oss.GptOssForCausalLM from an HF checkpoint dir."""
    return convert_state_dict(st_io.load_state_dict(path), load_config(path))


def hf_layout(params) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape} each leaf of a converted `params` tree came from: RULES run backwards, each
    expert matrix [E, in, out] reported as the release stores it, its MXFP4 pair `<w>_blocks`
    [E, out, in/32, 16] and `<w>_scales` [E, out, in/32]. Reads no checkpoint file."""
    layout = invert_rules(params, RULES)
    out = {}
    for name, shape in layout.items():
        if re.fullmatch(QUANTIZED, name):
            E, n_in, n_out = shape
            out[name + "_blocks"], out[name + "_scales"] = (E, n_out, n_in // 32, 16), (E, n_out, n_in // 32)
        else:
            out[name] = shape
    return out
