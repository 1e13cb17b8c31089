"""Write the tiny random-weight checkpoints under assets/checkpoints/<family>/.

Each checkpoint has the real release's HF layout (config.json keys, tensor names and
[out, in] layouts) with small dims. Weights come from numpy with a fixed seed, and every
file is written deterministically (sorted json keys, tensors in sorted-name order), so
`python tools/make_checkpoints.py` reproduces the committed assets byte for byte.

`python tools/make_checkpoints.py --release llama-3.2-1b --out DIR [--layers N]` writes instead a random-weight
checkpoint with that release's exact config.json, sharded (2 GB shards + index json) in bf16, as published:
the recorder and grader then run at the real shapes (`checkpoint=DIR`).

`python tools/make_checkpoints.py --scale small --family F|all [--out DIR] [--dtype float32|bfloat16]` writes the
~100M-parameter `small` checkpoint of a family (tools/checkpoints_small.py; default DIR
$T2J_CACHE_DIR/checkpoints/small/<family>, never under assets/; with --family all, DIR/<family>).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

__all__ = ["BUILDERS", "RELEASES", "make_llama3", "make_release", "write_checkpoint", "write_json", "write_sharded",
           "shard_checkpoint", "main"]

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets" / "checkpoints"
SAFETENSORS_METADATA = {"format": "pt"}  # what HF save_pretrained writes


# ---- shared helpers -------------------------------------------------------------------------

def write_json(path: Path, obj) -> None:
    """Deterministic json: sorted keys, 2-space indent, trailing newline."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    # Sorted insertion order so the header, and so the bytes, never depend on dict order.
    ordered = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
    save_file(ordered, str(path), metadata=SAFETENSORS_METADATA)


def write_checkpoint(out_dir, config: dict, tensors: dict[str, np.ndarray],
                     generation_config: dict | None = None) -> Path:
    """Write config.json, generation_config.json (if given) and model.safetensors into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    if generation_config is not None:
        write_json(out / "generation_config.json", generation_config)
    save_tensors(out / "model.safetensors", tensors)
    return out


def normal(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def norm_weight(rng: np.random.Generator, dim: int) -> np.ndarray:
    # 1 + small noise: an RMSNorm that drops or misplaces its weight (or uses 1+w) shows up.
    return (np.float32(1.0) + normal(rng, (dim,), 0.1)).astype(np.float32)


# ---- llama3 ---------------------------------------------------------------------------------

LLAMA3_SEED = 3
LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|begin_of_text|>
    "eos_token_id": [401, 404],  # <|end_of_text|>, <|eot_id|>
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    # Llama 3.1 rope scaling; original_max_position_embeddings shrunk from 8192 to 64 so that
    # with head_dim 16 the low, medium (blended) and high frequency branches are all exercised.
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 512,
}
LLAMA3_GENERATION_CONFIG = {
    "bos_token_id": 400,
    "do_sample": True,
    "eos_token_id": [401, 404],
    "temperature": 0.6,
    "top_p": 0.9,
}


# A wider output head than initializer_range: LoRA cannot touch lm_head or the final norm, and with
# std 0.02 on a 64-wide model no adapter can move the logits enough to learn the SFT data (measured:
# 7.9% held-out drop at 0.02, 37% at 0.1). Drawn last, so every other tensor is unchanged.
LLAMA3_LM_HEAD_STD = 0.1


def llama3_tensor_stream(config: dict, seed: int):
    """(HF name, random tensor) of a Llama ([out, in] layout), drawn in module order from one rng, one at a
    time (a release-sized model never sits in memory whole)."""
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", normal(rng, (vocab, d), std)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm_weight(rng, d)
        for name, shape in [("q_proj", (q_out, d)), ("k_proj", (kv_out, d)),
                            ("v_proj", (kv_out, d)), ("o_proj", (d, q_out))]:
            yield p + f"self_attn.{name}.weight", normal(rng, shape, std)
        yield p + "post_attention_layernorm.weight", norm_weight(rng, d)
        for name, shape in [("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))]:
            yield p + f"mlp.{name}.weight", normal(rng, shape, std)
    yield "model.norm.weight", norm_weight(rng, d)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", normal(rng, (vocab, d), LLAMA3_LM_HEAD_STD)


def llama3_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named Llama tensors ([out, in] layout), drawn in module order from one rng."""
    return dict(llama3_tensor_stream(config, seed))


def make_llama3(out_dir) -> Path:
    """Tiny Llama 3.1-format checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16)."""
    tensors = llama3_tensors(LLAMA3_CONFIG, LLAMA3_SEED)
    return write_checkpoint(out_dir, LLAMA3_CONFIG, tensors, LLAMA3_GENERATION_CONFIG)


# The PPO reward model: a second tiny Llama (its own weights, the same tokenizer, as LF requires) with TRL's
# value head in value_head.safetensors, as LF's `reward_model_type: full` loads it (load_valuehead_params).
LLAMA3_REWARD_SEED = 4
LLAMA3_REWARD_HEAD_STD = 0.5  # scores spread by about one unit over random responses: something to learn


def make_llama3_reward(out_dir) -> Path:
    """Tiny Llama 3.1-format reward model: the llama3 config, seed LLAMA3_REWARD_SEED, plus its value head."""
    out = write_checkpoint(out_dir, LLAMA3_CONFIG, llama3_tensors(LLAMA3_CONFIG, LLAMA3_REWARD_SEED),
                           LLAMA3_GENERATION_CONFIG)
    rng = np.random.default_rng(LLAMA3_REWARD_SEED + 1000)
    save_tensors(out / "value_head.safetensors",
                 {"v_head.summary.weight": normal(rng, (1, LLAMA3_CONFIG["hidden_size"]), LLAMA3_REWARD_HEAD_STD),
                  "v_head.summary.bias": np.zeros((1,), np.float32)})
    return out


def _sibling_builder(family: str, module: str | None = None):
    """make_<family> of tools/checkpoints_<module or family>.py (tools/ is not a package: loaded by path, on use)."""
    def build(out_dir) -> Path:
        import importlib.util
        name = f"checkpoints_{module or family}"
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, f"make_{family.replace('-', '_')}")(out_dir)
    return build


# One builder per checkpoint directory under assets/checkpoints/ (a family may have several, e.g. falcon's
# two attention layouts); the other families' builders live in tools/checkpoints_<family>.py, found by name.
SIBLING_FAMILIES = tuple(sorted(p.stem[len("checkpoints_"):] for p in Path(__file__).parent.glob("checkpoints_*.py")
                                if p.stem != "checkpoints_small"))
BUILDERS = {"llama3": make_llama3, "llama3-reward": make_llama3_reward,
            **{f: _sibling_builder(f) for f in SIBLING_FAMILIES},
            "falcon-mqa": _sibling_builder("falcon-mqa", "falcon"),  # Falcon-7B's multi-query layout (tests)
            "gemma4-release": _sibling_builder("gemma4-release", "gemma4")}  # the multimodal release layout


# ---- sharding (real HF index format), used by tests -----------------------------------------

def shard_checkpoint(src_dir, out_dir, max_tensors_per_shard: int) -> Path:
    """Re-save src_dir/model.safetensors as model-0000k-of-0000n.safetensors + index json.

    config.json and generation_config.json are copied alongside, so out_dir is a complete
    sharded checkpoint, as `save_pretrained(max_shard_size=...)` would leave it.
    """
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    groups = [names[i:i + max_tensors_per_shard] for i in range(0, len(names), max_tensors_per_shard)]
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        shard = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_tensors(out / shard, {n: tensors[n] for n in group})
        weight_map.update({n: shard for n in group})
    total_size = int(sum(tensors[n].nbytes for n in names))
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    for extra in ("config.json", "generation_config.json"):
        if (src / extra).exists():
            (out / extra).write_bytes((src / extra).read_bytes())
    return out


# ---- release-shaped checkpoints (random weights, a real release's exact config), never committed ---------

# meta-llama/Llama-3.2-1B config.json and generation_config.json, as published (transformers_version dropped)
LLAMA32_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA32_1B_GENERATION_CONFIG = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                                "temperature": 0.6, "top_p": 0.9}
# release name -> (config, generation config, tensor stream)
RELEASES = {"llama-3.2-1b": (LLAMA32_1B_CONFIG, LLAMA32_1B_GENERATION_CONFIG, llama3_tensor_stream)}
RELEASE_SEED = 0
MAX_SHARD_BYTES = 2 * 10**9  # save_pretrained's shard size when a release is pushed in shards


def write_sharded(out_dir, tensors, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a stream of (name, array) as model-0000k-of-0000n.safetensors + model.safetensors.index.json,
    as `save_pretrained(max_shard_size=...)` does: a shard closes before the tensor that would overflow it.
    Holds one shard in memory; shards are written under provisional names and renamed once n is known."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size, weight_map, total = [], {}, 0, {}, 0

    def flush():
        nonlocal current, size
        if current:
            part = out / f"part-{len(shards):05d}.tmp"
            save_tensors(part, current)
            shards.append((part, sorted(current)))
            current, size = {}, 0

    for name, array in tensors:
        if current and size + array.nbytes > max_shard_bytes:
            flush()
        current[name], size, total = array, size + array.nbytes, total + array.nbytes
    flush()
    for k, (part, names) in enumerate(shards, start=1):
        shard = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        part.replace(out / shard)
        weight_map.update({n: shard for n in names})
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))})
    return out


def make_release(name: str, out_dir, num_hidden_layers: int | None = None, dtype: str = "bfloat16",
                 max_shard_bytes: int = MAX_SHARD_BYTES, seed: int = RELEASE_SEED) -> Path:
    """A random-weight checkpoint with release `name`'s exact config (RELEASES), sharded with an index, stored
    in `dtype` (bfloat16 as published, or float32). `num_hidden_layers` keeps every width and the vocabulary
    but fewer layers (a release-shaped model a 2-core machine can run)."""
    import ml_dtypes

    config, generation_config, stream = RELEASES[name]
    config = {**config, **({"num_hidden_layers": num_hidden_layers} if num_hidden_layers else {}),
              "torch_dtype": dtype}
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    out = write_sharded(out_dir, ((n, a.astype(np_dtype)) for n, a in stream(config, seed)), max_shard_bytes)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config)
    return out


def _small_module():
    """tools/checkpoints_small.py (loaded by path, on use)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("checkpoints_small", Path(__file__).with_name("checkpoints_small.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help=f"tiny checkpoints to rebuild (default: all of {sorted(BUILDERS)})")
    ap.add_argument("--release", choices=sorted(RELEASES), help="instead: a random-weight checkpoint with this "
                    "release's exact config, sharded, into --out (gigabytes: never under assets/)")
    ap.add_argument("--out", type=Path, help="output directory of --release")
    ap.add_argument("--layers", type=int, help="--release with fewer decoder layers (same widths and vocabulary)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="stored dtype (--release: bfloat16 by default, "
                    "--scale small: float32)")
    ap.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES)
    ap.add_argument("--scale", choices=["tiny", "small"], default="tiny", help="small: the ~100M-parameter "
                    "checkpoint of --family (tools/checkpoints_small.py) into --out (default: the cache directory)")
    ap.add_argument("--family", help="--scale small: a family (llama3, llama3-reward, gemma4, ...) or `all`")
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    if args.release:
        if args.out is None:
            ap.error("--release needs --out")
        out = make_release(args.release, args.out, args.layers, args.dtype or "bfloat16", args.max_shard_bytes)
        print(f"wrote {out}")
        return
    if args.scale == "small":
        small = _small_module()
        if not args.family or (args.family != "all" and args.family not in small.SMALL_FAMILIES):
            ap.error(f"--scale small needs --family, one of all, {', '.join(small.SMALL_FAMILIES)}")
        families = small.SMALL_FAMILIES if args.family == "all" else (args.family,)
        for family in families:
            out = small.small_checkpoint_dir(family) if args.out is None else (
                args.out / family if args.family == "all" else args.out)
            small.write_atomic(family, out, args.dtype or "float32", replace=True)
            print(f"wrote {out} ({small.param_count(family) / 1e6:.1f}M parameters)")
        return
    for family in args.families or sorted(BUILDERS):
        out = BUILDERS[family](ASSETS / family)
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
