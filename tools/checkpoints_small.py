"""The `small` scale: a ~100M-parameter random-weight checkpoint of every recorded family (32k vocabulary).

`small_config(family)` is the family's tiny config (its builder's `<FAMILY>_CONFIG`) with the widths its
builder file names (SMALL_BASE, SMALL_OVERRIDES; Llama 3's here): hidden 768 (gpt_oss 512), 12 layers, vocab 32000, and the family's structure kept (GQA,
biases, fused projections, sliding windows crossed by 512-token sequences, gemma4's sliding/full pattern with
per-layer inputs and KV sharing, gpt_oss's MXFP4 experts, now 8 of them top-2). `make_small(family, out_dir)`
draws the tensors with the family's own generator (same seed as tiny) and streams them into a sharded
checkpoint (write_sharded: 200 MB shards + index json); `ensure_small(family)` writes it once into
`small_checkpoint_dir(family)` = $T2J_CACHE_DIR/checkpoints/small/<family> (default ~/.cache/t2j-refs),
through a temporary directory renamed into place, so an interrupted write never leaves half a checkpoint.
Hundreds of MB each: never under assets/.

The tiny builders widen some projections beyond initializer_range (the *_STD constants each builder file lists in SMALL_WIDE_STDS) so that
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

__all__ = ["SMALL_FAMILIES", "SMALL_VOCAB", "small_overrides", "text_keys", "SMALL_SEQ_LEN", "SMALL_SHARD_BYTES",
           "tiny_config", "small_config", "small_shapes", "param_count", "make_small", "small_checkpoint_dir",
           "ensure_small"]

TOOLS = Path(__file__).resolve().parent
SMALL_VOCAB = 32000
SMALL_SEQ_LEN = 512           # configs/scale/small.yaml: cutoff_len, max_model_len
SMALL_SHARD_BYTES = 200_000_000

def _sibling_families() -> tuple[str, ...]:
    """The families with a tools/checkpoints_<family>.py builder (this file aside)."""
    return tuple(sorted(p.stem[len("checkpoints_"):] for p in TOOLS.glob("checkpoints_*.py") if p.stem != "checkpoints_small"))


# family -> (tools module, config, generation config, seed, tensor generator) by name in that module: Llama 3's two
# checkpoints live in make_checkpoints.py; every other family's in tools/checkpoints_<family>.py, named by convention
SOURCES = {
    "llama3": ("make_checkpoints", "LLAMA3_CONFIG", "LLAMA3_GENERATION_CONFIG", "LLAMA3_SEED",
               "llama3_tensor_stream"),
    "llama3-reward": ("make_checkpoints", "LLAMA3_CONFIG", "LLAMA3_GENERATION_CONFIG", "LLAMA3_REWARD_SEED",
                      "llama3_tensor_stream"),
    **{f: (f"checkpoints_{f}", f"{f.upper()}_CONFIG", f"{f.upper()}_GENERATION_CONFIG", f"{f.upper()}_SEED",
           f"{f}_tensors") for f in _sibling_families()},
}
SMALL_FAMILIES = tuple(SOURCES)

_LLAMA_LIKE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_key_value_heads": 4, "vocab_size": SMALL_VOCAB, "max_position_embeddings": 2048}
# Llama 3.1's rope scaling as released (original 8192). transformers warns that it is not below
# max_position_embeddings (2048) but accepts it; the scaled frequencies do not depend on the sequence length.
_LLAMA3 = {**_LLAMA_LIKE, "head_dim": 64, "tie_word_embeddings": False,
           "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
SMALL_BASES = {"llama_like": _LLAMA_LIKE, None: {}}  # what a family file's SMALL_BASE may name


def _family_rows(family: str) -> tuple[dict, tuple[str, ...]]:
    """(config overrides, wide stds) of a family at scale=small: Llama 3's here, every other family's in its own
    tools/checkpoints_<family>.py (SMALL_BASE, SMALL_OVERRIDES, SMALL_WIDE_STDS)."""
    if family in ("llama3", "llama3-reward"):  # the value head: scores spread by about one unit, as tiny's
        return _LLAMA3, ("LLAMA3_REWARD_HEAD_STD",) if family == "llama3-reward" else ()
    mod = _load(SOURCES[family][0])
    if not hasattr(mod, "SMALL_OVERRIDES"):
        raise ValueError(f"tools/checkpoints_{family}.py has no SMALL_OVERRIDES: the family has no small scale")
    overrides = {**SMALL_BASES[getattr(mod, "SMALL_BASE", None)], **mod.SMALL_OVERRIDES}
    if text_keys(overrides).get("vocab_size") != SMALL_VOCAB:
        raise ValueError(f"tools/checkpoints_{family}.py: SMALL_OVERRIDES vocab_size must be {SMALL_VOCAB}")
    return overrides, tuple(getattr(mod, "SMALL_WIDE_STDS", ()))


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


def small_overrides(family: str) -> dict:
    """What scale=small changes of the family's tiny config (a copy)."""
    return copy.deepcopy(_family_rows(family)[0])


def small_config(family: str) -> dict:
    """The family's tiny config with the small widths (SMALL_OVERRIDES): a complete config.json dict."""
    return {**tiny_config(family), **copy.deepcopy(_family_rows(family)[0])}


def text_keys(config: dict) -> dict:
    """A config's language-model keys at one level: a release that nests them (Qwen3-VL's text_config, Qwen2.5-Omni's
    thinker_config.text_config) flattened, the inner keys winning; any other config as it is."""
    thinker = config.get("thinker_config", config)
    return {**config, **thinker, **thinker.get("text_config", {})}


def _width_factor(family: str) -> float:
    tiny, small = text_keys(tiny_config(family))["hidden_size"], text_keys(small_config(family))["hidden_size"]
    return math.sqrt(tiny / small)


def _module(family: str) -> types.ModuleType:
    """The family's builder module with its WIDE_STDS rescaled for the small widths."""
    mod = _load(SOURCES[family][0])
    factor = _width_factor(family)
    for name in _family_rows(family)[1]:
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
