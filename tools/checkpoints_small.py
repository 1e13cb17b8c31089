"""The `small` scale: a ~100M-parameter random-weight checkpoint of every recorded family (32k vocabulary).

`small_config(family)` is the family's tiny config (its builder's `<FAMILY>_CONFIG`) with the widths of
SMALL_OVERRIDES: hidden 768 (gpt_oss 512), 12 layers, vocab 32000, and the family's structure kept (GQA,
biases, fused projections, sliding windows crossed by 512-token sequences, gemma4's sliding/full pattern with
per-layer inputs and KV sharing, gpt_oss's MXFP4 experts, now 8 of them top-2). `make_small(family, out_dir)`
draws the tensors with the family's own generator (same seed as tiny) and streams them into a sharded
checkpoint (write_sharded: 200 MB shards + index json); `ensure_small(family)` writes it once into
`small_checkpoint_dir(family)` = $T2J_CACHE_DIR/checkpoints/small/<family> (default ~/.cache/t2j-refs),
through a temporary directory renamed into place, so an interrupted write never leaves half a checkpoint.
Hundreds of MB each: never under assets/.

The tiny builders widen some projections beyond initializer_range (the *_STD constants in WIDE_STDS) so that
a 64-wide model's attention scores and activations are O(1); at small widths those stds are multiplied by
sqrt(tiny hidden / small hidden), which keeps the same per-unit statistics. Stds tied to initializer_range or
to 1/sqrt(fan_in) need nothing.

`param_count(family)` counts from the shapes the generator produces, without drawing a number: the generator
runs with its random helpers replaced by zero-stride broadcast arrays (`small_shapes`). MXFP4 experts count as
their dequantized weights (2 per block byte; scales are not parameters).

`python tools/make_checkpoints.py --scale small --family F|all [--out DIR] [--dtype float32|bfloat16]`.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

__all__ = ["SMALL_FAMILIES", "SMALL_OVERRIDES", "SMALL_VOCAB", "SMALL_SEQ_LEN", "SMALL_SHARD_BYTES", "WIDE_STDS",
           "tiny_config", "small_config", "small_shapes", "param_count", "make_small", "small_checkpoint_dir",
           "ensure_small"]

TOOLS = Path(__file__).resolve().parent
SMALL_VOCAB = 32000
SMALL_SEQ_LEN = 512           # configs/scale/small.yaml: cutoff_len, max_model_len
SMALL_SHARD_BYTES = 200_000_000

# family -> (tools module, config, generation config, seed, tensor generator) by name in that module
SOURCES = {
    "llama3": ("make_checkpoints", "LLAMA3_CONFIG", "LLAMA3_GENERATION_CONFIG", "LLAMA3_SEED",
               "llama3_tensor_stream"),
    "llama3-reward": ("make_checkpoints", "LLAMA3_CONFIG", "LLAMA3_GENERATION_CONFIG", "LLAMA3_REWARD_SEED",
                      "llama3_tensor_stream"),
    "gemma4": ("checkpoints_gemma4", "GEMMA4_CONFIG", "GEMMA4_GENERATION_CONFIG", "GEMMA4_SEED", "gemma4_tensors"),
    "bloom": ("checkpoints_bloom", "BLOOM_CONFIG", "BLOOM_GENERATION_CONFIG", "BLOOM_SEED", "bloom_tensors"),
    "falcon": ("checkpoints_falcon", "FALCON_CONFIG", "FALCON_GENERATION_CONFIG", "FALCON_SEED", "falcon_tensors"),
    "mistral": ("checkpoints_mistral", "MISTRAL_CONFIG", "MISTRAL_GENERATION_CONFIG", "MISTRAL_SEED",
                "mistral_tensors"),
    "qwen2": ("checkpoints_qwen2", "QWEN2_CONFIG", "QWEN2_GENERATION_CONFIG", "QWEN2_SEED", "qwen2_tensors"),
    "qwen3": ("checkpoints_qwen3", "QWEN3_CONFIG", "QWEN3_GENERATION_CONFIG", "QWEN3_SEED", "qwen3_tensors"),
    "phi4": ("checkpoints_phi4", "PHI4_CONFIG", "PHI4_GENERATION_CONFIG", "PHI4_SEED", "phi4_tensors"),
    "starcoder2": ("checkpoints_starcoder2", "STARCODER2_CONFIG", "STARCODER2_GENERATION_CONFIG", "STARCODER2_SEED",
                   "starcoder2_tensors"),
    "gpt_oss": ("checkpoints_gpt_oss", "GPT_OSS_CONFIG", "GPT_OSS_GENERATION_CONFIG", "GPT_OSS_SEED",
                "gpt_oss_tensors"),
}
SMALL_FAMILIES = tuple(SOURCES)

_S, _F = "sliding_attention", "full_attention"
_LLAMA_LIKE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_key_value_heads": 4, "vocab_size": SMALL_VOCAB, "max_position_embeddings": 2048}
# Llama 3.1's rope scaling as released (original 8192). transformers warns that it is not below
# max_position_embeddings (2048) but accepts it; the scaled frequencies do not depend on the sequence length.
_LLAMA3 = {**_LLAMA_LIKE, "head_dim": 64, "tie_word_embeddings": False,
           "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
SMALL_OVERRIDES: dict[str, dict] = {
    "llama3": _LLAMA3,
    "llama3-reward": _LLAMA3,
    # a window of 256: 512-token sequences cross it (tiny: 16 against 33 / 64)
    "mistral": {**_LLAMA_LIKE, "sliding_window": 256},
    # GQA 12/2 like Qwen2.5-0.5B's 14/2; sliding window off as released (window = context, all layers)
    "qwen2": {**_LLAMA_LIKE, "num_key_value_heads": 2, "max_window_layers": 12, "sliding_window": 2048},
    # head_dim 128 != hidden / heads (96), as the 0.6B's 128 != 1024 / 16
    "qwen3": {**_LLAMA_LIKE, "num_attention_heads": 8, "head_dim": 128, "max_window_layers": 12},
    # rotary dim 48 of head_dim 64 (partial_rotary_factor 0.75 kept): longrope's factors, one per rotary pair,
    # spread over the tiny checkpoint's ranges; at the original length 2048 = max, only the short ones apply
    "phi4": {**_LLAMA_LIKE, "original_max_position_embeddings": 2048,
             # factor 1.0 = max / original, written out (transformers warns once when it has to infer it)
             "rope_scaling": {"type": "longrope", "factor": 1.0, "short_factor": [1.0 + 0.35 * i / 23 for i in range(24)],
                              "long_factor": [14.0 ** (i / 23) for i in range(24)]}},
    "starcoder2": {**_LLAMA_LIKE, "intermediate_size": 3072, "sliding_window": 256},
    # 12 heads: not a power of two, so the extra ALiBi slopes stay in use; MLP 4 x hidden (fixed by BLOOM)
    "bloom": {"hidden_size": 768, "n_head": 12, "n_layer": 12, "vocab_size": SMALL_VOCAB},
    # new decoder architecture, 12 query heads in 4 KV groups; MLP 4 x hidden (the release's default)
    "falcon": {"hidden_size": 768, "num_attention_heads": 12, "num_kv_heads": 4, "num_hidden_layers": 12,
               "vocab_size": SMALL_VOCAB},
    # E2B-style: 5 sliding layers then a full one (twice; the last layer is full), full layers with head_dim 128,
    # per-layer inputs of 32 a layer, the last 4 layers share KV (double-wide MLP), window 256, softcap kept
    "gemma4": {"hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_key_value_heads": 4, "head_dim": 64, "layer_types": ([_S] * 5 + [_F]) * 2,
               "per_layer_config": {"05": {"head_dim": 128}, "11": {"head_dim": 128}},  # zero-padded as 5.24 saves
               "hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": SMALL_VOCAB,
               "num_kv_shared_layers": 4, "sliding_window": 256, "vocab_size": SMALL_VOCAB},
    # 8 experts top-2 (the 20b: 32 top-4), hidden = intermediate as released (512: MXFP4 groups of 32 divide
    # both), GQA 8/2, sliding/full alternating with the release's window of 128; YaRN as released
    "gpt_oss": {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                "experts_per_token": 2, "layer_types": [_S, _F] * 6, "sliding_window": 128,
                "vocab_size": SMALL_VOCAB},
}
# The tiny builders' stds wider than initializer_range, chosen for a 64/96-wide model: rescaled by
# sqrt(tiny hidden / small hidden) at small widths (the module docstring).
WIDE_STDS = {
    "bloom": ("BLOOM_WIDE_STD",),
    "phi4": ("PHI4_IN_PROJ_STD",),
    "starcoder2": ("IN_PROJ_STD",),
    "gpt_oss": ("ATTN_STD", "ROUTER_STD", "GATE_UP_STD", "DOWN_STD"),
    "llama3-reward": ("LLAMA3_REWARD_HEAD_STD",),  # the value head: scores spread by about one unit, as tiny's
}


def _load(module: str) -> types.ModuleType:
    """A fresh instance of tools/<module>.py (tools/ is not a package), so patching it touches nothing else."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))  # the builders import make_checkpoints by name
    spec = importlib.util.spec_from_file_location(f"_small_{module}", TOOLS / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_config(family: str) -> dict:
    """The family's tiny config.json dict (a copy)."""
    module, config, *_ = SOURCES[family]
    return copy.deepcopy(getattr(_load(module), config))


def small_config(family: str) -> dict:
    """The family's tiny config with the small widths (SMALL_OVERRIDES): a complete config.json dict."""
    return {**tiny_config(family), **copy.deepcopy(SMALL_OVERRIDES[family])}


def _width_factor(family: str) -> float:
    tiny, small = tiny_config(family)["hidden_size"], small_config(family)["hidden_size"]
    return math.sqrt(tiny / small)


def _module(family: str) -> types.ModuleType:
    """The family's builder module with its WIDE_STDS rescaled for the small widths."""
    mod = _load(SOURCES[family][0])
    factor = _width_factor(family)
    for name in WIDE_STDS.get(family, ()):
        setattr(mod, name, getattr(mod, name) * factor)
    return mod


def _stream(mod: types.ModuleType, family: str, config: dict, seed: int | None = None):
    """(name, array) of every tensor, one at a time where the generator streams (llama3); a dict-building
    generator's tensors are handed out in sorted-name order and dropped from the dict as they go."""
    _, _, _, seed_name, fn = SOURCES[family]
    made = getattr(mod, fn)(config, getattr(mod, seed_name) if seed is None else seed)
    if isinstance(made, dict):
        return ((name, made.pop(name)) for name in sorted(made))
    return made


# ---- shapes without numbers -------------------------------------------------------------------------------

def _shape_of(shape, dtype=np.float32) -> np.ndarray:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return np.broadcast_to(np.zeros((), dtype), shape)  # zero-stride: no memory, whatever the shape


def _shape_helpers() -> types.SimpleNamespace:
    return types.SimpleNamespace(normal=lambda rng, shape, std: _shape_of(shape),
                                 norm_weight=lambda rng, dim: _shape_of((dim,)))


def small_shapes(family: str, config: dict | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """{HF name: (shape, dtype name)} of every tensor make_small writes for `config` (default small_config),
    from the family's own generator run on shape-only stand-ins for its random helpers (no tensor drawn)."""
    config = small_config(family) if config is None else config
    mod = _load(SOURCES[family][0])
    if family == "gemma4":  # its generator is `_draw` over `_tensor_shapes`
        return {n: (tuple(s), "float32") for n, s in mod._tensor_shapes(config).items()}
    helpers = _shape_helpers()
    for name in ("normal", "norm_weight"):
        if hasattr(mod, name):
            setattr(mod, name, getattr(helpers, name))
    if hasattr(mod, "_tools"):  # falcon, phi4, starcoder2 fetch the helpers through _tools()
        mod._tools = lambda: helpers
    if family == "gpt_oss":
        mod._expert_weight = lambda rng, shape, std: _shape_of(shape)
        mod.mxfp4_encode = lambda w: (_shape_of((*w.shape[:-1], w.shape[-1] // 32, 16), np.uint8),
                                      _shape_of((*w.shape[:-1], w.shape[-1] // 32), np.uint8))
    out = {name: (tuple(a.shape), a.dtype.name) for name, a in _stream(mod, family, config)}
    if family == "llama3-reward":
        out |= _value_head_shapes(config)
    return out


def _value_head_shapes(config: dict) -> dict:
    return {"v_head.summary.weight": ((1, config["hidden_size"]), "float32"), "v_head.summary.bias": ((1,), "float32")}


def param_count(family: str, config: dict | None = None) -> int:
    """Parameters of the family's small model (or of `config`), from small_shapes: MXFP4 `*_blocks` hold two
    weights a byte, `*_scales` none; a reward model's value head counts."""
    total = 0
    for name, (shape, _) in small_shapes(family, config).items():
        n = math.prod(shape)
        total += 2 * n if name.endswith("_blocks") else 0 if name.endswith("_scales") else n
    return total


# ---- writing ----------------------------------------------------------------------------------------------

def make_small(family: str, out_dir, dtype: str = "float32", max_shard_bytes: int = SMALL_SHARD_BYTES) -> Path:
    """Write the family's small checkpoint into out_dir: config.json, generation_config.json, 200 MB shards +
    model.safetensors.index.json (and the reward model's value_head.safetensors). Tensors are drawn one at a
    time (llama3) or once (the dict builders, handed on and dropped as written), floating ones stored in
    `dtype`; the same seed as the tiny checkpoint, so the bytes are reproducible."""
    import ml_dtypes

    mod = _module(family)
    tools = mod if SOURCES[family][0] == "make_checkpoints" else _load("make_checkpoints")
    config = small_config(family)
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ([] if dtype == "float32" else ["torch_dtype"])
    config |= {k: dtype for k in keys}  # a config without the key stays without it at float32 (as tiny)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    stream = ((n, a.astype(np_dtype) if a.dtype.kind == "f" and a.dtype != np_dtype else a)
              for n, a in _stream(mod, family, config))
    out = tools.write_sharded(out_dir, stream, max_shard_bytes)
    tools.write_json(out / "config.json", config)
    tools.write_json(out / "generation_config.json", getattr(mod, SOURCES[family][2]))
    if family == "llama3-reward":  # TRL's value head, as make_llama3_reward draws it
        rng = np.random.default_rng(mod.LLAMA3_REWARD_SEED + 1000)
        tools.save_tensors(out / "value_head.safetensors", {
            "v_head.summary.weight": mod.normal(rng, (1, config["hidden_size"]), mod.LLAMA3_REWARD_HEAD_STD),
            "v_head.summary.bias": np.zeros((1,), np.float32)})
    return out


def small_checkpoint_dir(family: str) -> Path:
    """Where the small checkpoint of `family` lives: $T2J_CACHE_DIR/checkpoints/small/<family>
    (T2J_CACHE_DIR defaults to ~/.cache/t2j-refs)."""
    base = os.environ.get("T2J_CACHE_DIR") or str(Path.home() / ".cache" / "t2j-refs")
    return Path(base).expanduser() / "checkpoints" / "small" / family


def write_atomic(family: str, out_dir, dtype: str = "float32", replace: bool = False, log=print) -> Path:
    """make_small into a temporary sibling of out_dir, then renamed to out_dir (replacing it if `replace`),
    so out_dir is either absent or complete."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        make_small(family, tmp, dtype)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if replace and out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            out.rename(old / out.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not another writer's complete checkpoint
                raise
            log(f"{out} was written meanwhile by another process: kept it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_small(family: str, out_dir=None, dtype: str = "float32", log=print) -> Path:
    """The family's small checkpoint directory (default small_checkpoint_dir), written first if it is absent."""
    out = Path(out_dir) if out_dir is not None else small_checkpoint_dir(family)
    if (out / "config.json").is_file():
        return out
    log(f"scale=small: writing the {family} checkpoint ({param_count(family) / 1e6:.0f}M parameters, {dtype}) "
        f"to {out} (first use only)")
    return write_atomic(family, out, dtype, log=log)


if __name__ == "__main__":  # the same as `python tools/make_checkpoints.py --scale small ...`
    _load("make_checkpoints").main(["--scale", "small", *sys.argv[1:]])
