"""Serving-class properties of the live twin: the torch half (trusted process).

Each property draws fresh inputs from np.random.default_rng((seed, key)) and runs them through the torch source
(torch_sources/serving and the family's training-side model); twin/candidate_side/serving.py runs the same inputs
through the candidate's serving_engine/, jax_oracles/ and conversion/. Diagnostics with no torch counterpart
(importable, jit_static) return the value a correct candidate observes.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import zlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

import torch_sources
from torch_sources.models import mrope
from torch_sources.models.loading import load_config, tensor_index
from torch_sources.models.mxfp4 import dequantize_mxfp4
from torch_sources.serving import paged_attention as pa
from torch_sources.serving import sampler as smp
from torch_sources.serving.config import EngineConfig, SamplingParams
from torch_sources.serving.engine import LLMEngine
from torch_sources.serving.model_runner import ModelRunner
from twin.properties import CONVERSION_RULES, Property
from twin.shared import flat_config, layout_arrays, pad_rows, serve

__all__ = ["properties", "make_ctx", "draw", "run"]

SRC = Path(torch_sources.__file__).resolve().parent
ATTN_MODULES = ("serving_engine/paged_attention.py", "serving_engine/kernels/dispatch.py",
                "serving_engine/kernels/blocked_attention.py")
KERNEL_MODULES = ("serving_engine/kernels/ragged_paged_attention.py",)
SAMPLER_OPS = ("penalties", "temperature", "min_p", "top_k_top_p", "greedy", "random")
PACKAGES = ("serving_engine.kernels", "serving_engine.models")
JIT_LENS = (10, 13)  # two prompt lengths every sane bucketing puts in one bucket (9..16)


def t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x))


def n(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _import(model_module: str):  # "models/llama3.py" -> torch_sources.models.llama3
    return importlib.import_module("torch_sources." + model_module[:-3].replace("/", "."))


def _mirror(obj) -> str:
    """The candidate file mirroring the torch file that defines obj (the mirror rule of docs/CONTRACTS.md)."""
    rel = Path(inspect.getsourcefile(inspect.unwrap(obj))).resolve().relative_to(SRC).as_posix()
    return "serving_engine/" + rel[len("serving/"):] if rel.startswith("serving/") else "jax_oracles/" + rel


def _unique(*paths) -> tuple[str, ...]:
    return tuple(dict.fromkeys(paths))


# ---- the task, statically (no model loaded) -----------------------------------------------------------------

class Task:
    def __init__(self, spec):
        fam = spec.family
        self.spec, self.features, self.ckpt = spec, spec.features, spec.assets["checkpoint"]
        self.name, self.prefix, self.model_module = fam["name"], fam["model_prefix"], fam["model_module"]
        self.family = _import(self.model_module)
        self.lm = _import((fam.get("language_model") or {}).get("module", self.model_module))
        self.serving = importlib.import_module(f"torch_sources.serving.models.{self.name}")
        self.engine_config = EngineConfig(**spec.cfg["mode"]["engine"])
        self.workload = spec.cfg["mode"]["workload"]
        self.config_class = next(getattr(self.family, c) for c in self.family.__all__
                                 if c.startswith(self.prefix) and c.endswith("Config"))

    @property
    def serving_file(self) -> str:
        return _mirror(self.serving)

    @property
    def attn_variant(self) -> str:
        """The family's attention features as one suffix ("" when it has none)."""
        tags = [("attn:sliding_window", "window"), ("attn:softcap", "softcap"), ("attn:sinks", "sinks")]
        return "_".join(s for tag, s in tags if tag in self.features)


class Ctx:
    """The torch model and engine pieces, loaded once per task."""

    def __init__(self, spec):
        self.task = Task(spec)
        self.probes = {p.prop.key: p for p in probes(self.task)}

    @cached_property
    def runner(self) -> ModelRunner:
        return ModelRunner(self.task.ckpt, self.task.engine_config)

    @property
    def config(self):
        return self.runner.model_config

    @property
    def lm_config(self):  # a vision-language config's language model
        return getattr(self.config, "text", self.config)

    @cached_property
    def prompt_vocab(self) -> int:
        """Token ids random prompts draw below: a vision-language family's special tokens (its config's
        *_token_id, all past the text ids) stay out of text prompts."""
        if not any(f.startswith("vision:") for f in self.task.features):
            return self.config.vocab_size
        d = load_config(self.task.ckpt)
        return min(int(v) for k, v in d.items() if k.endswith("_token_id") and isinstance(v, int))

    def prompt(self, rng, length: int) -> np.ndarray:
        return rng.integers(3, self.prompt_vocab, int(length)).astype(np.int32)


# ---- L0 -----------------------------------------------------------------------------------------------------

def draw_none(ctx, rng):
    return {}


def run_config(ctx, inp):
    return flat_config(ctx.task.config_class.from_pretrained(ctx.task.ckpt))


def run_param_tree(ctx, inp):
    """The checkpoint tensors the model reads, by HF name (a Gemma 4 release's text model under its text names,
    towers skipped) -> sorted names, then their shapes."""
    layout = {name: tuple(e["shape"]) for name, (_, e) in tensor_index(ctx.task.ckpt).items()}
    if hasattr(ctx.task.family, "text_state_dict"):
        layout = ctx.task.family.text_state_dict(ctx.config, layout)
    return layout_arrays(layout)


def candidate_modules(task: Task) -> list[str]:
    """Every serving module of the torch source under its candidate name, the JAX-only kernels, the family."""
    serving = sorted(p.stem for p in (SRC / "serving").glob("*.py") if p.stem != "__init__")
    return ([f"serving_engine.{m}" for m in serving] + ["serving_engine.kernels", "serving_engine.models",
            f"serving_engine.models.{task.name}", "jax_oracles." + task.model_module[:-3].replace("/", "."),
            f"conversion.{task.name}"])


def module_file(module: str) -> str:
    return module.replace(".", "/") + ("/__init__.py" if module in PACKAGES else ".py")


def draw_importable(ctx, rng):
    return {"modules": np.array(candidate_modules(ctx.task))}


def run_importable(ctx, inp):
    return {str(m): np.int32(1) for m in inp["modules"]}


# ---- L1: sampler --------------------------------------------------------------------------------------------

def draw_sampler(ctx, rng):
    B, V = 6, 512
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    # a tie at the top of row 0 (greedy, no top-k/top-p: the order of a sort among ties is the sort's own)
    logits[0, rng.choice(V, 3, replace=False)] = logits[0].max() + 1  # greedy takes the first index
    counts = (rng.random((B, V)) < 0.3) * rng.integers(1, 4, (B, V))
    probs = np.exp(logits - logits.max(-1, keepdims=True)) * (rng.random((B, V)) < 0.7)  # some tokens masked
    return {"logits": logits, "prompt_ids_mask": rng.random((B, V)) < 0.05,
            "output_counts": counts.astype(np.int32),
            "repetition_penalty": rng.uniform(0.8, 1.6, B).astype(np.float32),
            "presence_penalty": rng.uniform(-1.5, 2.0, B).astype(np.float32),
            "frequency_penalty": rng.uniform(-1.0, 1.0, B).astype(np.float32),
            "temperature": np.array([0.0, *rng.uniform(0.3, 2.0, B - 1)], np.float32),
            "min_p": np.array([0.0, *rng.uniform(0.01, 0.3, B - 1)], np.float32),
            "top_k": np.array([0, 1, *rng.integers(2, 60, B - 2)], np.int32),
            "top_p": np.array([1.0, *rng.uniform(0.3, 0.99, B - 1)], np.float32),
            "probs": (probs / probs.sum(-1, keepdims=True)).astype(np.float32),
            "noise": rng.standard_exponential((B, V), dtype=np.float32)}


def sampler_runner(op: str) -> Callable:
    def run_op(ctx, inp):
        x = t(inp["logits"])
        if op == "penalties":
            return {"logits": n(smp.apply_penalties(x, *(t(inp[k]) for k in (
                "prompt_ids_mask", "output_counts", "repetition_penalty", "presence_penalty", "frequency_penalty"))))}
        if op == "temperature":
            return {"logits": n(smp.apply_temperature(x, t(inp["temperature"])))}
        if op == "min_p":  # masks with -inf: the kept set is the result
            return {"kept": n(torch.isfinite(smp.apply_min_p(x, t(inp["min_p"]))))}
        if op == "top_k_top_p":
            return {"kept": n(torch.isfinite(smp.apply_top_k_top_p(x, t(inp["top_k"]), t(inp["top_p"]))))}
        if op == "greedy":
            return {"ids": n(smp.greedy_sample(x)).astype(np.int64)}
        return {"ids": n(smp.random_sample(t(inp["probs"]), t(inp["noise"]))).astype(np.int64)}
    return run_op


# ---- L1: paged KV cache and ragged paged attention ----------------------------------------------------------

def draw_write_kv(ctx, rng):
    P, S, K, H, T = 12, 4, 2, 8, 10
    slots = rng.permutation(P * S)[:T].astype(np.int32)
    slots[rng.choice(T, 3, replace=False)] = -1  # padding tokens: not written
    return {"k_pages": rng.standard_normal((P, S, K, H), np.float32),
            "v_pages": rng.standard_normal((P, S, K, H), np.float32),
            "k_new": rng.standard_normal((T, K, H), np.float32), "v_new": rng.standard_normal((T, K, H), np.float32),
            "slot_mapping": slots}


def run_write_kv(ctx, inp):
    k, v = pa.write_to_kv_cache(*(t(inp[x]).clone() for x in ("k_pages", "v_pages", "k_new", "v_new")),
                                t(inp["slot_mapping"]))
    return {"k_pages": n(k), "v_pages": n(v)}


def draw_ragged(ctx, rng, variant: str) -> dict:
    """A ragged step of four sequences in random order (a prefill, a decode after a context longer than one
    64-key kernel block, a chunk after a context, a short decode), one padding row and padding tokens, over a
    shuffled page pool. `variant` adds a sliding window, a soft cap, attention sinks."""
    K, G, H, S = 2, 2, 16, 4
    N = K * G
    kinds = [(int(rng.integers(8, 21)), 0), (1, int(rng.integers(65, 140))),
             (int(rng.integers(2, 7)), int(rng.integers(3, 12))), (1, int(rng.integers(0, 9)))]
    q_lens, ctx_lens = map(np.array, zip(*(kinds[i] for i in rng.permutation(4))))
    kv_lens = np.append(q_lens + ctx_lens, 0).astype(np.int32)  # the fifth row is padding
    pages_per_seq = -(-int(kv_lens.max()) // S) + 1
    P = 5 * pages_per_seq + 3
    T = -(-int(q_lens.sum()) // 8) * 8 + 8  # a padded token bucket
    case = {"q": (rng.standard_normal((T, N, H)) * 2).astype(np.float32),
            "k_pages": rng.standard_normal((P, S, K, H), np.float32),
            "v_pages": rng.standard_normal((P, S, K, H), np.float32), "kv_lens": kv_lens,
            "page_indices": rng.permutation(P)[:5 * pages_per_seq].reshape(5, pages_per_seq).astype(np.int32),
            "cu_q_lens": np.concatenate([[0], np.cumsum(q_lens), [q_lens.sum()]]).astype(np.int32),
            "num_seqs": np.array([4], np.int32), "sm_scale": np.float32(H ** -0.5),
            # a window shorter than the prefill and the chunk's context, so it bites in every sequence
            "sliding_window": np.int32(rng.integers(2, 9) if "window" in variant else 0),
            "soft_cap": np.float32(rng.uniform(2.0, 6.0) if "softcap" in variant else 0.0)}
    if "sinks" in variant:  # some sinks above every score (they take most of the weight), some below
        case["sinks"] = (rng.standard_normal(N) * 2 + np.tile([4.0, -3.0], K)).astype(np.float32)
    return case


def attention_runner(outputs: tuple[str, ...]) -> Callable:
    def run_attention(ctx, inp):
        out = pa.ragged_paged_attention(
            *(t(inp[k]) for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")),
            sm_scale=float(inp["sm_scale"]), sliding_window=int(inp["sliding_window"]) or None,
            soft_cap=float(inp["soft_cap"]) or None, sinks=t(inp["sinks"]) if "sinks" in inp else None)
        live = n(out)[: int(inp["cu_q_lens"][int(inp["num_seqs"][0])])]
        return {k: live for k in outputs}
    return run_attention


# ---- L1: the family's operators -----------------------------------------------------------------------------

def draw_rms_norm(ctx, rng):
    D = ctx.lm_config.hidden_size
    return {"x": (rng.standard_normal((3, D)) * 2).astype(np.float32),
            "weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}


def run_rms_norm(ctx, inp):
    return {"y": n(ctx.task.lm.rms_norm(t(inp["x"]), t(inp["weight"]), ctx.lm_config.rms_norm_eps))}


def inv_freqs(lm, config) -> dict:
    """{layer type: the RoPE table} (one "default" entry unless rope_inv_freq takes a layer type)."""
    if "layer_type" in inspect.signature(lm.rope_inv_freq).parameters:
        return {lt: lm.rope_inv_freq(config, lt) for lt in sorted(set(config.layer_types))}
    return {"default": lm.rope_inv_freq(config)}


def draw_rope(ctx, rng):
    inp = {"position_ids": np.sort(rng.integers(0, 2048, (1, 12))).astype(np.int32)}
    if "pos:mrope" in ctx.task.features:  # three rows apart, so each section's row shows
        inp["mrope_position_ids"] = np.sort(rng.integers(0, 512, (3, 1, 12)), axis=-1).astype(np.int32)
    return inp


def run_rope(ctx, inp):
    lm, c, out = ctx.task.lm, ctx.lm_config, {}
    factor = (lm.rope_attention_factor(c),) if hasattr(lm, "rope_attention_factor") else ()
    for lt, inv in inv_freqs(lm, c).items():
        cos, sin = lm.rope_cos_sin(inv, t(inp["position_ids"]), *factor)
        out.update({f"{lt}.inv_freq": n(inv), f"{lt}.cos": n(cos), f"{lt}.sin": n(sin)})
    if "mrope_position_ids" in inp:
        cos, sin = mrope.mrope_cos_sin(lm.rope_inv_freq(c), t(inp["mrope_position_ids"]), ctx.config.mrope_section,
                                       interleaved=False)
        out.update({"mrope.cos": n(cos), "mrope.sin": n(sin)})
    return out


def draw_moe_routing(ctx, rng):
    E, k = ctx.config.num_local_experts, ctx.config.num_experts_per_tok
    logits = (rng.standard_normal((16, E)) * 2).astype(np.float32)
    logits[3] = logits[3, 0]  # every expert tied
    logits[5, :2] = logits[5].max() + 1  # a tie inside the top k
    row = -np.sort(-logits[7])
    row[k] = row[k - 1]  # a tie across the k-th place, at random indices: the lower index goes first
    logits[7] = row[rng.permutation(E)]
    return {"router_logits": logits}


def run_moe_routing(ctx, inp):
    weights, idx = ctx.task.family.route(t(inp["router_logits"]), ctx.config.num_experts_per_tok)
    return {"routing": n(torch.zeros(inp["router_logits"].shape).scatter_(1, idx.long(), weights))}


def draw_swiglu(ctx, rng):
    return {"gate_up": (rng.standard_normal((8, 2 * ctx.config.intermediate_size)) * 5).astype(np.float32)}


def run_swiglu(ctx, inp):
    c = ctx.config
    return {"y": n(ctx.task.family.swiglu_clamped(t(inp["gate_up"]), c.swiglu_alpha, c.swiglu_limit))}


def draw_mxfp4(ctx, rng):  # uint8 travels as int32
    return {"blocks": rng.integers(0, 256, (2, 4, 2, 16)).astype(np.int32),
            "scales": rng.integers(110, 140, (2, 4, 2)).astype(np.int32)}


def run_mxfp4(ctx, inp):
    return {"values": n(dequantize_mxfp4(*(t(inp[k].astype(np.uint8)) for k in ("blocks", "scales"))))}


# ---- L2 -----------------------------------------------------------------------------------------------------

def probed_layers(config) -> list[int]:
    """Layer 0, and the first layer of another type (Gemma 4's full layers, GPT-OSS's) that owns a cache."""
    shapes, types = pa.layer_kv_shapes(config), getattr(config, "layer_types", None) or ()
    other = [i for i, lt in enumerate(types) if lt != types[0] and shapes[i] is not None]
    return [0, *other[:1]]


def draw_decoder_layer(ctx, rng):
    """A ragged step of two sequences and a padding row over the engine's page pool: a prefill, and a chunk after
    cached tokens whose K/V is whatever the (random) pages hold; padding tokens to 16."""
    c, cfg = ctx.config, ctx.task.engine_config
    S, P, T = cfg.block_size, cfg.num_blocks, 16
    q_lens, ctx_lens = np.array([rng.integers(3, 10), rng.integers(2, 6)]), np.array([0, rng.integers(3, 10)])
    kv_lens = q_lens + ctx_lens
    width = -(-int(kv_lens.max()) // S)
    table = rng.permutation(P)[:3 * width].reshape(3, width).astype(np.int32)
    pos = [np.arange(ctx_lens[i], kv_lens[i]) for i in range(2)]
    slots = np.concatenate([table[i, p // S] * S + p % S for i, p in enumerate(pos)])
    live = int(q_lens.sum())
    inp = {"hidden": rng.standard_normal((T, c.hidden_size), np.float32),
           "positions": np.pad(np.concatenate(pos), (0, T - live)).astype(np.int32),
           "slot_mapping": np.pad(slots, (0, T - live), constant_values=-1).astype(np.int32),
           "kv_lens": np.append(kv_lens, 0).astype(np.int32), "page_indices": table,
           "cu_q_lens": np.array([0, q_lens[0], live, live], np.int32), "num_seqs": np.array([2], np.int32)}
    if "pos:mrope" in ctx.task.features:  # three position rows apart, so each M-RoPE section's row shows
        inp["positions"] = np.sort(rng.integers(0, 2 * T, (3, T)), axis=1).astype(np.int32)
    shapes = pa.layer_kv_shapes(c)
    ple = "per_layer_input" in inspect.signature(ctx.task.serving.decoder_layer_paged).parameters
    for i in probed_layers(c):
        inp[f"layer{i}.k_pages"] = rng.standard_normal((P, S, *shapes[i]), np.float32)
        inp[f"layer{i}.v_pages"] = rng.standard_normal((P, S, *shapes[i]), np.float32)
        if ple and getattr(c, "hidden_size_per_layer_input", 0):
            inp[f"layer{i}.per_layer_input"] = rng.standard_normal((T, c.hidden_size_per_layer_input), np.float32)
    return inp


def layer_cache(cache, i: int, k, v):
    """The cache with layer i's pages replaced (the others as allocated)."""
    ks, vs = list(cache.k), list(cache.v)
    ks[i], vs[i] = k, v
    return dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))


def run_decoder_layer(ctx, inp):
    fn, model, out = ctx.task.serving.decoder_layer_paged, ctx.runner.model, {}
    meta = pa.AttentionMetadata(**{k: t(inp[k]) for k in ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens",
                                                            "num_seqs")})
    live = int(inp["cu_q_lens"][-1])
    for i in probed_layers(ctx.config):
        cache = layer_cache(pa.allocate_kv_cache(ctx.config, ctx.task.engine_config), i,
                            t(inp[f"layer{i}.k_pages"]).clone(), t(inp[f"layer{i}.v_pages"]).clone())
        ple = ([t(inp[f"layer{i}.per_layer_input"]) if f"layer{i}.per_layer_input" in inp else None]
               if "per_layer_input" in inspect.signature(fn).parameters else [])
        hidden, cache = fn(model, i, t(inp["hidden"]), *ple, t(inp["positions"]), cache, meta)
        out.update({f"layer{i}.k_pages": n(cache.k[i]), f"layer{i}.v_pages": n(cache.v[i]),
                    f"layer{i}.hidden": n(hidden)[:live]})
    return out


def draw_moe_block(ctx, rng):
    return {"x": (rng.standard_normal((1, 12, ctx.config.hidden_size)) * 2).astype(np.float32)}


def run_moe_block(ctx, inp):
    return {"y": n(ctx.runner.model.model.layers[0].mlp(t(inp["x"])))}


# ---- L3 / L4 ------------------------------------------------------------------------------------------------

def draw_prefill(ctx, rng):
    return {"token_ids": ctx.prompt(rng, rng.integers(5, min(40, ctx.task.engine_config.max_model_len)))}


def run_prefill(ctx, inp):
    return {"logits": n(ctx.runner.prefill_logits(inp["token_ids"].tolist()))}


def draw_image(rng) -> np.ndarray:  # uint8[H,W,3] travels as int32; small: a few merged patch rows
    return rng.integers(0, 256, (int(rng.integers(20, 90)), int(rng.integers(20, 90)), 3)).astype(np.int32)


def image_prompt(ctx, rng) -> np.ndarray:
    """Text, one image framed as the chat template frames it (vision start, the image token, vision end), text."""
    d = load_config(ctx.task.ckpt)
    image = [d["vision_start_token_id"], d["image_token_id"], d["vision_end_token_id"]]
    head, tail = ctx.prompt(rng, rng.integers(2, 8)), ctx.prompt(rng, rng.integers(2, 8))
    return np.concatenate([head, image, tail]).astype(np.int32)


def draw_prefill_image(ctx, rng):
    return {"token_ids": image_prompt(ctx, rng), "image": draw_image(rng)}


def run_prefill_image(ctx, inp):
    """The image's way through the runner: the expanded prompt, the processed pixels, the tower's rows, the logits."""
    ids, image, fam = inp["token_ids"].tolist(), inp["image"].astype(np.uint8), ctx.runner.family
    expanded, _, _ = ctx.runner.prepare_images(ids, [image])
    pixels, grid = fam.process_image(ctx.config, image)
    return {"prompt_token_ids": np.array(expanded, np.int64), "image_grid_thw": np.array(grid, np.int64),
            "pixel_values": n(pixels).astype(np.float32),
            "image_rows": n(fam.embed_multimodal(ctx.runner.model, pixels, grid)),
            "logits": n(ctx.runner.prefill_logits(ids, [image]))}


def draw_jit_static(ctx, rng):
    return {f"prompt_{i}": ctx.prompt(rng, L) for i, L in enumerate(JIT_LENS)}


def run_jit_static(ctx, inp):
    return {"recompilations": np.int64(0)}  # eager torch compiles nothing; a jitted engine compiles the bucket once


def draw_decode(ctx, rng):
    return {"prompt": ctx.prompt(rng, rng.integers(4, 20)), "continuation": ctx.prompt(rng, rng.integers(3, 8))}


def run_decode(ctx, inp):
    logits, snap = ModelRunner(ctx.task.ckpt, ctx.task.engine_config).teacher_forced_decode(
        inp["prompt"].tolist(), inp["continuation"].tolist())
    # the cache first: a wrong write shows there before it shows in the logits
    return {**{"cache." + k: v for k, v in snap.items()}, "logits": n(logits)}


# ---- L5 -----------------------------------------------------------------------------------------------------

def draw_engine(ctx, rng):
    """Four greedy requests of different lengths and one seeded sampled request, arriving over the first steps;
    the third starts with the first one's two full blocks (+1 token), so a prefix cache reuses them; a
    multimodal family's fourth request holds an image (`image_3`)."""
    S, (lo, hi) = ctx.task.engine_config.block_size, ctx.task.workload["prompt_len"]
    lens = rng.integers(max(lo, 2 * S + 2), max(hi, 2 * S + 3) + 1, 5)
    prompts = [ctx.prompt(rng, L) for L in lens]
    prompts[2][: 2 * S + 1] = prompts[0][: 2 * S + 1]
    images = {}
    if ctx.runner.multimodal:  # the fourth request shows an image
        prompts[3], images["image_3"] = image_prompt(ctx, rng), draw_image(rng)
    return {"prompts": pad_rows(prompts, dtype=np.int32), **images,
            "arrival_step": np.array([0, 0, 2, 1, 1], np.int32),
            "max_tokens": rng.integers(3, 8, 5).astype(np.int32),
            "temperature": np.array([0, 0, 0, 0, rng.uniform(0.6, 1.5)], np.float32),
            "top_k": np.array([0, 0, 0, 0, rng.integers(0, 40)], np.int32),
            "top_p": np.array([1, 1, 1, 1, rng.uniform(0.7, 1.0)], np.float32),
            "seed": np.array([-1, -1, -1, -1, rng.integers(0, 2 ** 31)], np.int64)}


def run_engine(ctx, inp):
    return serve(LLMEngine(ctx.task.ckpt, ctx.task.engine_config), SamplingParams, inp)


# ---- the table ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Probe:
    prop: Property
    draw: Callable
    run: Callable


def probe(key: str, what: str, modules, draw_fn: Callable, run_fn: Callable, rtol: float = 1e-4) -> Probe:
    return Probe(Property(key, what, _unique(*modules), rtol), draw_fn, run_fn)


def probes(task: Task) -> list[Probe]:
    """This task's probes in level order; each names the candidate files it exercises first-hand."""
    fam, lm, srv, conv = task.family, task.lm, task.serving, f"conversion/{task.name}.py"
    fam_file, srv_file, runner = "jax_oracles/" + task.model_module, task.serving_file, "serving_engine/model_runner.py"
    out = [probe("L0/config", "the family config from config.json, field by field", [fam_file, conv], draw_none,
                 run_config, rtol=0.0),
           probe("L0/param_tree", "hf_layout(load_params): every checkpoint tensor by name and shape",
                 [conv, CONVERSION_RULES],
                 draw_none, run_param_tree),
           probe("L0/importable", "the serving engine, kernels, family model and converter import",
                 map(module_file, candidate_modules(task)), draw_importable, run_importable)]
    out += [probe(f"L1/sampler_{op}", f"sampler {op} on random logits", ["serving_engine/sampler.py"], draw_sampler,
                  sampler_runner(op)) for op in SAMPLER_OPS]
    out.append(probe("L1/write_to_kv_cache", "paged KV write by slot, padding slots skipped",
                     ["serving_engine/kernels/write_kv.py", "serving_engine/paged_attention.py"], draw_write_kv,
                     run_write_kv))
    for variant in dict.fromkeys(["", task.attn_variant]):
        suffix, draw_case = f"_{variant}" if variant else "", functools.partial(draw_ragged, variant=variant)
        what = f"ragged paged attention {variant}".rstrip()
        out += [probe(f"L1/paged_attention{suffix}", what + ": the serving path (Pallas on GPU, blocked jnp on CPU)",
                      ATTN_MODULES, draw_case, attention_runner(("out",))),
                probe(f"L1/paged_attention_kernel{suffix}", what + ": the jnp reference, then the Pallas kernel "
                      "(interpreted on CPU)", KERNEL_MODULES, draw_case, attention_runner(("reference", "kernel")))]
    out += [probe("L1/rms_norm", "the language model's RMSNorm", [_mirror(lm.rms_norm)], draw_rms_norm, run_rms_norm),
            probe("L1/rope", "RoPE tables (per layer type, YaRN factor, M-RoPE sections)",
                  [_mirror(lm.rope_inv_freq), _mirror(lm.rope_cos_sin)]
                  + ["jax_oracles/models/mrope.py"] * ("pos:mrope" in task.features), draw_rope, run_rope)]
    if "mlp:moe" in task.features:
        out += [probe("L1/moe_routing", "top-k expert routing weights, ties included", [_mirror(fam.route)],
                      draw_moe_routing, run_moe_routing),
                probe("L1/swiglu_clamped", "the experts' clamped SwiGLU", [_mirror(fam.swiglu_clamped)],
                      draw_swiglu, run_swiglu)]
    if "quant:mxfp4" in task.features:
        out.append(probe("L1/mxfp4_dequant", "MXFP4 blocks and scales to f32", ["conversion/mxfp4.py", conv],
                         draw_mxfp4, run_mxfp4))
    if hasattr(srv, "decoder_layer_paged"):
        out.append(probe("L2/decoder_layer_paged", "one decoder layer per layer type on a ragged step: the cache "
                         "pages after the write, then the hidden", [_mirror(srv.decoder_layer_paged), srv_file,
                                                                     _mirror(lm)], draw_decoder_layer,
                         run_decoder_layer))
    if "mlp:moe" in task.features:
        out.append(probe("L2/moe_block", "layer 0's MoE MLP", [fam_file], draw_moe_block, run_moe_block))
    forward = _mirror(srv.forward_paged)
    out.append(probe("L3/prefill", "ModelRunner.prefill_logits of a random prompt", [runner, forward, srv_file],
                     draw_prefill, run_prefill))
    if getattr(srv, "MULTIMODAL", False):
        vision = [f"jax_oracles/{m}" for m in task.spec.family.get("mirrored") or () if "vision" in m]
        out.append(probe("L3/prefill_image", "a prompt with a random image: expanded ids, pixels, tower rows, logits",
                         [runner, srv_file, *vision], draw_prefill_image, run_prefill_image))
    out += [probe("L3/jit_static", "two prefills in one token bucket compile once (LLMEngine.stats)",
                  [runner, "serving_engine/engine.py"], draw_jit_static, run_jit_static),
            probe("L4/decode_step", "teacher-forced decode: the cache after it, then each step's logits",
                  [runner, "serving_engine/paged_attention.py", forward], draw_decode, run_decode),
            probe("L5/engine_step", f"LLMEngine ({task.engine_config.mode} mode) on staggered ragged requests: stats, "
                  "log-probs, output ids", ["serving_engine/engine.py", "serving_engine/scheduler.py",
                                            "serving_engine/kv_cache_manager.py"], draw_engine, run_engine)]
    return out


# ---- the interface ------------------------------------------------------------------------------------------

def properties(spec) -> list[Property]:
    return [p.prop for p in probes(Task(spec))]


def make_ctx(spec) -> Ctx:
    return Ctx(spec)


def rng_for(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(key.encode())])


def arrays(d: dict) -> dict[str, np.ndarray]:  # numpy scalars as 0-d arrays
    return {k: np.asarray(v) for k, v in d.items()}


def draw(ctx: Ctx, seed: int) -> dict[str, dict[str, np.ndarray]]:
    return {key: arrays(p.draw(ctx, rng_for(seed, key))) for key, p in ctx.probes.items()}


def run(ctx: Ctx, key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # eager small-batch ops on a tiny model: threads cost far more than they give
    try:
        with torch.no_grad():
            return arrays(ctx.probes[key].run(ctx, inputs))
    finally:
        torch.set_num_threads(threads)
