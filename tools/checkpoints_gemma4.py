"""Tiny Gemma 4 text checkpoint (E2B-style) in the release's HF format, from numpy.

`make_gemma4(out_dir)` writes config.json, generation_config.json and model.safetensors
exactly as transformers 5.24 `Gemma4ForCausalLM.save_pretrained` lays them out (same
config keys, tensor names and [out, in] layouts; tied lm_head, so no `lm_head.weight`),
only with small dims. Features the config turns on: sliding/full layers [s,f,s,f], a
larger head_dim on full layers (`per_layer_config`), proportional partial rope on full
layers, per-layer input embeddings (PLE), KV sharing over the last 2 layers with a
double-wide MLP there, final logit soft-capping, and a learned `layer_scalar`.

Weights come from one `np.random.default_rng(GEMMA4_SEED)` drawn in sorted tensor-name
order, so `python tools/checkpoints_gemma4.py` reproduces the files byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

__all__ = ["GEMMA4_SEED", "GEMMA4_CONFIG", "GEMMA4_GENERATION_CONFIG", "gemma4_tensors", "make_gemma4", "main"]

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "assets" / "checkpoints" / "gemma4"
GEMMA4_SEED = 4

# Keys and values as transformers 5.24 save_pretrained writes them for this tiny config
# (checked once against Gemma4TextConfig(...).save_pretrained; tests/test_gemma4_model.py
# re-checks that transformers round-trips this dict unchanged).
GEMMA4_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": False,
    "bos_token_id": 2,
    "dtype": "float32",
    "enable_moe_block": False,
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "hidden_size_per_layer_input": 16,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gemma4_text",
    "moe_intermediate_size": None,
    "num_attention_heads": 4,
    "num_experts": None,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 2,
    "pad_token_id": 0,
    # `global_head_dim=32` is saved as a per-layer override of every full-attention layer.
    "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 32}},
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 8,
    "tie_word_embeddings": True,
    "top_k_experts": None,
    "transformers_version": "5.24.0",
    "use_bidirectional_attention": None,
    "use_cache": True,
    "use_double_wide_mlp": True,
    "vocab_size": 512,
    "vocab_size_per_layer_input": 512,
}

GEMMA4_GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "output_attentions": False,
    "output_hidden_states": False,
    "pad_token_id": 0,
    "transformers_version": "5.24.0",
    "use_cache": True,
}


def _tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the release stores, derived from the config dict."""
    D, L, P = c["hidden_size"], c["num_hidden_layers"], c["hidden_size_per_layer_input"]
    H = c["num_attention_heads"]
    first_shared = L - c["num_kv_shared_layers"]
    shapes = {
        "model.embed_tokens.weight": (c["vocab_size"], D),
        "model.embed_tokens_per_layer.weight": (c["vocab_size_per_layer_input"], L * P),
        "model.per_layer_model_projection.weight": (L * P, D),
        "model.per_layer_projection_norm.weight": (P,),
        "model.norm.weight": (D,),
    }
    for i in range(L):
        over = c["per_layer_config"].get(str(i), {})
        hd = over.get("head_dim", c["head_dim"])
        kv = over.get("num_key_value_heads", c["num_key_value_heads"])
        shared = i >= first_shared
        inter = c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and shared else 1)
        p = f"model.layers.{i}."
        shapes |= {
            p + "layer_scalar": (1,),
            p + "self_attn.q_proj.weight": (H * hd, D),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.o_proj.weight": (D, H * hd),
            p + "mlp.gate_proj.weight": (inter, D),
            p + "mlp.up_proj.weight": (inter, D),
            p + "mlp.down_proj.weight": (D, inter),
            p + "per_layer_input_gate.weight": (P, D),
            p + "per_layer_projection.weight": (D, P),
        }
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            shapes[p + norm + ".weight"] = (D,)
        if not shared:  # KV-shared layers store no k/v projections or k_norm (v_norm has no weight)
            shapes |= {
                p + "self_attn.k_proj.weight": (kv * hd, D),
                p + "self_attn.v_proj.weight": (kv * hd, D),
                p + "self_attn.k_norm.weight": (hd,),
            }
    return shapes


def _draw(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("layer_scalar"):
        # Non-trivial scalar, so a model that skips it (or scales only the branch) shows up.
        sign = rng.choice([-1.0, 1.0], shape)
        return (1.0 + sign * rng.uniform(0.2, 0.5, shape)).astype(np.float32)
    if "norm" in name:
        # Gemma 4 norms scale by the plain weight (identity = 1); jitter it so a 1+w bug shows.
        return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name:
        # Tied lm_head, so std trades peakedness against self-prediction (the residual carries
        # the input token's embedding to the head): 0.25 gives logits of std ~2 and a top
        # probability of ~0.3 on average, a non-degenerate next-token distribution.
        return (0.25 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def gemma4_tensors(config: dict = GEMMA4_CONFIG, seed: int = GEMMA4_SEED) -> dict[str, np.ndarray]:
    """All checkpoint tensors, drawn from one rng in sorted-name order (f32, HF [out, in] layout)."""
    rng = np.random.default_rng(seed)
    shapes = _tensor_shapes(config)
    return {name: _draw(rng, name, shapes[name]) for name in sorted(shapes)}


def _write_json(path: Path, obj) -> None:
    # Same serialisation as transformers' to_json_string: sorted keys, indent 2, trailing newline.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_gemma4(out_dir=OUT_DIR) -> Path:
    """Write {config.json, generation_config.json, model.safetensors} into out_dir; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", GEMMA4_CONFIG)
    _write_json(out / "generation_config.json", GEMMA4_GENERATION_CONFIG)
    tensors = gemma4_tensors()
    save_file({k: np.ascontiguousarray(tensors[k]) for k in sorted(tensors)},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    print(make_gemma4(argv[0] if argv else OUT_DIR))


if __name__ == "__main__":
    main()
