"""Tiny Gemma 4 text checkpoint (E2B-style) in the release's HF format, from numpy.

`make_gemma4(out_dir)` writes config.json, generation_config.json and model.safetensors
exactly as transformers 5.24 `Gemma4ForCausalLM.save_pretrained` lays them out (same
config keys, tensor names and [out, in] layouts; tied lm_head, so no `lm_head.weight`),
only with small dims. Features the config turns on: sliding/full layers [s,f,s,f], a
larger head_dim on full layers (`per_layer_config`), proportional partial rope on full
layers, per-layer input embeddings (PLE), KV sharing over the last 2 layers with a
double-wide MLP there, final logit soft-capping, and a learned `layer_scalar`.

`make_gemma4_release(out_dir)` writes the second checkpoint, in the layout of a Gemma 4
*release* directory (31B style): `Gemma4ForConditionalGeneration`, config.json `model_type`
"gemma4" with the language model under `text_config` (in the release's key form:
`global_head_dim`, `num_global_key_value_heads`) beside a tiny `vision_config`; language
weights under `model.language_model.*` beside the vision tower and its embedder. Its text
model has no per-layer inputs (`hidden_size_per_layer_input` 0), full layers with a larger
head dim, one KV head instead of two and K = V (`attention_k_eq_v`, no v_proj), no KV sharing.

Weights come from one `np.random.default_rng(seed)` drawn in sorted tensor-name
order, so `python tools/checkpoints_gemma4.py` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import write_checkpoint  # noqa: E402

__all__ = ["GEMMA4_SEED", "GEMMA4_CONFIG", "GEMMA4_GENERATION_CONFIG", "gemma4_tensors", "make_gemma4",
           "GEMMA4_RELEASE_SEED", "GEMMA4_RELEASE_CONFIG", "gemma4_release_tensors", "make_gemma4_release", "main"]

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "assets" / "checkpoints" / "gemma4"
RELEASE_OUT_DIR = ROOT / "assets" / "checkpoints" / "gemma4-release"
GEMMA4_SEED = 4
GEMMA4_RELEASE_SEED = 31

# Keys and values as transformers 5.24 save_pretrained writes them for this tiny config
# (checked once against Gemma4TextConfig(...).save_pretrained; tests/models/test_gemma4_model.py
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


# The release's multimodal config.json: the keys transformers 5.24 Gemma4ForConditionalGeneration.save_pretrained
# writes for this tiny config, except that text_config keeps the release's `global_head_dim` /
# `num_global_key_value_heads` (5.24 resolves them into `per_layer_config`; tests/models/test_gemma4_release.py checks
# that transformers resolves both forms alike). No audio tower (audio_config null), as in the 31B release.
GEMMA4_RELEASE_TEXT_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": True,
    "bos_token_id": 2,
    "enable_moe_block": False,
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 32,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "hidden_size_per_layer_input": 0,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gemma4_text",
    "moe_intermediate_size": None,
    "num_attention_heads": 4,
    "num_experts": None,
    "num_global_key_value_heads": 1,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 0,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 8,
    "tie_word_embeddings": True,
    "top_k_experts": None,
    "use_bidirectional_attention": None,
    "use_cache": True,
    "use_double_wide_mlp": False,
    "vocab_size": 512,
    "vocab_size_per_layer_input": 262144,  # the class default, kept although there is no PLE (as released)
}
GEMMA4_RELEASE_VISION_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "max_position_embeddings": 131072,
    "model_type": "gemma4_vision",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "patch_size": 4,
    "pooling_kernel_size": 2,
    "position_embedding_size": 64,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"},
    "standardize": False,
    "use_clipped_linears": False,
}
GEMMA4_RELEASE_CONFIG = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "audio_config": None,
    "audio_token_id": 258881,
    "boa_token_id": 256000,
    "boi_token_id": 255999,
    "dtype": "float32",
    "eoa_token_index": 258883,
    "eoi_token_id": 258882,
    "image_token_id": 258880,
    "initializer_range": 0.02,
    "model_type": "gemma4",
    "text_config": GEMMA4_RELEASE_TEXT_CONFIG,
    "tie_word_embeddings": True,
    "transformers_version": "5.24.0",
    "video_token_id": 258884,
    "vision_config": GEMMA4_RELEASE_VISION_CONFIG,
}


def _per_layer_overrides(c: dict) -> dict[str, dict]:
    """A text config's per-layer head shapes: its per_layer_config, or the release's global_* keys on full layers
    (num_global_key_value_heads only with attention_k_eq_v, as transformers resolves them)."""
    if "per_layer_config" in c:  # keys as saved, zero-padded past 10 layers ("05")
        return {str(int(i)): o for i, o in c["per_layer_config"].items()}
    over = {"head_dim": c["global_head_dim"]}
    if c["attention_k_eq_v"] and c.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = c["num_global_key_value_heads"]
    return {str(i): over for i, t in enumerate(c["layer_types"]) if t == "full_attention"}


def _tensor_shapes(c: dict, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every text-model tensor the release stores, derived from the (text) config dict."""
    D, L, P = c["hidden_size"], c["num_hidden_layers"], c["hidden_size_per_layer_input"]
    H = c["num_attention_heads"]
    first_shared = L - c["num_kv_shared_layers"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], D), "model.norm.weight": (D,)}
    if P:  # per-layer inputs (PLE)
        shapes |= {
            "model.embed_tokens_per_layer.weight": (c["vocab_size_per_layer_input"], L * P),
            "model.per_layer_model_projection.weight": (L * P, D),
            "model.per_layer_projection_norm.weight": (P,),
        }
    overrides = _per_layer_overrides(c)
    for i in range(L):
        over = overrides.get(str(i), {})
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
        }
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (D,)
        if P:
            shapes |= {
                p + "per_layer_input_gate.weight": (P, D),
                p + "per_layer_projection.weight": (D, P),
                p + "post_per_layer_input_norm.weight": (D,),
            }
        if not shared:  # KV-shared layers store no k/v projections or k_norm (v_norm has no weight)
            shapes |= {p + "self_attn.k_proj.weight": (kv * hd, D), p + "self_attn.k_norm.weight": (hd,)}
            if not (c["attention_k_eq_v"] and c["layer_types"][i] == "full_attention"):  # K = V: no v_proj
                shapes[p + "self_attn.v_proj.weight"] = (kv * hd, D)
    return {prefix + name[len("model."):] if name.startswith("model.") else name: shape
            for name, shape in shapes.items()}


def _vision_shapes(v: dict, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The release's vision tower and its embedder into the LM (what a text-only source skips)."""
    Dv, Iv, hd = v["hidden_size"], v["intermediate_size"], v["head_dim"]
    t = "model.vision_tower."
    shapes = {
        "model.embed_vision.embedding_projection.weight": (text_hidden, Dv),
        t + "patch_embedder.input_proj.weight": (Dv, 3 * v["patch_size"] ** 2),
        t + "patch_embedder.position_embedding_table": (2, v["position_embedding_size"], Dv),
    }
    for i in range(v["num_hidden_layers"]):
        p = f"{t}encoder.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.linear.weight": (v["num_attention_heads"] * hd, Dv),
            p + "self_attn.k_proj.linear.weight": (v["num_key_value_heads"] * hd, Dv),
            p + "self_attn.v_proj.linear.weight": (v["num_key_value_heads"] * hd, Dv),
            p + "self_attn.o_proj.linear.weight": (Dv, v["num_attention_heads"] * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.linear.weight": (Iv, Dv),
            p + "mlp.up_proj.linear.weight": (Iv, Dv),
            p + "mlp.down_proj.linear.weight": (Dv, Iv),
        }
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (Dv,)
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


def gemma4_release_tensors(config: dict = GEMMA4_RELEASE_CONFIG, seed: int = GEMMA4_RELEASE_SEED
                           ) -> dict[str, np.ndarray]:
    """The release-layout checkpoint's tensors: language model under model.language_model.*, vision tower beside."""
    text = config["text_config"]
    shapes = _tensor_shapes(text, prefix="model.language_model.")
    shapes |= _vision_shapes(config["vision_config"], text["hidden_size"])
    rng = np.random.default_rng(seed)
    return {name: _draw(rng, name, shapes[name]) for name in sorted(shapes)}


def make_gemma4(out_dir=OUT_DIR) -> Path:
    """Write {config.json, generation_config.json, model.safetensors} into out_dir; return it."""
    return write_checkpoint(out_dir, GEMMA4_CONFIG, gemma4_tensors(), GEMMA4_GENERATION_CONFIG)


def make_gemma4_release(out_dir=RELEASE_OUT_DIR) -> Path:
    """Write the release-layout {config.json, generation_config.json, model.safetensors} into out_dir."""
    return write_checkpoint(out_dir, GEMMA4_RELEASE_CONFIG, gemma4_release_tensors(), GEMMA4_GENERATION_CONFIG)


def main(argv: list[str] | None = None) -> None:
    """`python tools/checkpoints_gemma4.py [OUT_DIR [RELEASE_OUT_DIR]]`: both checkpoints."""
    argv = sys.argv[1:] if argv is None else argv
    print(make_gemma4(argv[0] if argv else OUT_DIR))
    print(make_gemma4_release(argv[1] if len(argv) > 1 else RELEASE_OUT_DIR))


if __name__ == "__main__":
    main()


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = None
# E2B-style: 5 sliding layers then a full one (twice; the last layer is full), full layers with head_dim 128,
# per-layer inputs of 32 a layer, the last 4 layers share KV (double-wide MLP), window 256, softcap kept
SMALL_OVERRIDES = {"hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_key_value_heads": 4, "head_dim": 64,
                   "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
                   "per_layer_config": {"05": {"head_dim": 128}, "11": {"head_dim": 128}},  # zero-padded as 5.24 saves
                   "hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": 32000,
                   "num_kv_shared_layers": 4, "sliding_window": 256, "vocab_size": 32000}
