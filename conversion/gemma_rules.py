"""The release rows PaliGemma and Gemma 3 share: the Gemma decoder under `language_model.model.*` and the SigLIP
tower under `vision_tower.vision_model.*`, as (HF name regex, "/"-separated param path, transform) rows of
conversion/rules.py, and transformers 5's saved tower names read under the release's. Their own module so that one
family's converter never imports the other family's model (a task's solution carries what its imports reach).
"""

from __future__ import annotations

import re

from conversion.rules import keep, linear

__all__ = ["GEMMA_RULES", "SIGLIP_RULES", "release_names"]

_LM, _LM_P = r"language_model\.model\.", "model/language_model/"
_NORMS = "input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
# (HF name regex, "/"-separated param path, transform): the Gemma decoders' rows (Gemma 3's q/k norms and sandwich
# norms match nothing in a Gemma 1 checkpoint)
GEMMA_RULES = [
    (_LM + r"embed_tokens\.weight", _LM_P + "embed_tokens/embedding", keep),
    (_LM + r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", _LM_P + "layers_{0}/self_attn/{1}/kernel",
     linear),
    (_LM + r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.bias", _LM_P + "layers_{0}/self_attn/{1}/bias", keep),
    (_LM + r"layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight", _LM_P + "layers_{0}/self_attn/{1}/weight", keep),
    (_LM + r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", _LM_P + "layers_{0}/mlp/{1}/kernel", linear),
    (_LM + rf"layers\.(\d+)\.({_NORMS})\.weight", _LM_P + "layers_{0}/{1}/weight", keep),
    (_LM + r"norm\.weight", _LM_P + "norm/weight", keep),
    (r"language_model\.lm_head\.weight", "lm_head/kernel", linear),
]
_V, _V_P = r"vision_tower\.vision_model\.", "model/vision_tower/"
SIGLIP_RULES = [
    (_V + r"embeddings\.patch_embedding\.(weight|bias)", _V_P + "embeddings/patch_embedding/{0}", keep),
    (_V + r"embeddings\.position_embedding\.weight", _V_P + "embeddings/position_embedding/embedding", keep),
    (_V + r"encoder\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight",
     _V_P + "encoder/layers_{0}/self_attn/{1}/kernel", linear),
    (_V + r"encoder\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.bias",
     _V_P + "encoder/layers_{0}/self_attn/{1}/bias", keep),
    (_V + r"encoder\.layers\.(\d+)\.mlp\.(fc1|fc2)\.weight", _V_P + "encoder/layers_{0}/mlp/{1}/kernel", linear),
    (_V + r"encoder\.layers\.(\d+)\.mlp\.(fc1|fc2)\.bias", _V_P + "encoder/layers_{0}/mlp/{1}/bias", keep),
    (_V + r"encoder\.layers\.(\d+)\.(layer_norm1|layer_norm2)\.(weight|bias)", _V_P + "encoder/layers_{0}/{1}/{2}", keep),
    (_V + r"post_layernorm\.(weight|bias)", _V_P + "post_layernorm/{0}", keep),
]

def release_names(state: dict) -> dict:
    """transformers 5's saved tower names (`vision_tower.X`) under the release's (`vision_tower.vision_model.X`)."""
    return {re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", k): v for k, v in state.items()}
