"""Serving-class properties of the live twin: the candidate half, run in the sealed torch-free child.

Reaches the candidate's serving_engine/, jax_oracles/ and conversion/ through their public names only (the
contracts of docs/CONTRACTS.md); the inputs come from twin/torch_side/serving.py, whose probes return the same
names and shapes; what both halves do alike is in twin/shared.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
from functools import cached_property, wraps

import jax
import jax.numpy as jnp
import numpy as np
from twin.shared import flat_config, importable, layout_arrays, serve

__all__ = ["make_ctx", "PROBES"]

jax.config.update("jax_default_matmul_precision", "highest")


def sv(name: str):
    return importlib.import_module(f"serving_engine.{name}")


def j(x):
    return jnp.asarray(np.asarray(x))


class Ctx:
    def __init__(self, meta: dict):
        task, fam = meta["task"], meta["task"]["family"]
        self.ckpt = meta["assets"]["checkpoint"]
        self.name, self.prefix, self.model_module = fam["name"], fam["model_prefix"], fam["model_module"]
        self.lm_module = (fam.get("language_model") or {}).get("module", self.model_module)
        self.engine = task["mode"]["engine"]

    def _jax(self, model_module: str):
        return importlib.import_module("jax_oracles." + model_module[:-3].replace("/", "."))

    @cached_property
    def family(self):
        return self._jax(self.model_module)

    @cached_property
    def lm(self):
        return self._jax(self.lm_module)

    @cached_property
    def conversion(self):
        return importlib.import_module(f"conversion.{self.name}")

    @cached_property
    def serving(self):
        return sv(f"models.{self.name}")

    @cached_property
    def engine_config(self):
        return sv("config").EngineConfig(**self.engine)

    @cached_property
    def loaded(self):  # (config, model) of the serving family
        return self.serving.load_model(self.ckpt)

    @property
    def config(self):
        return self.loaded[0]

    @property
    def lm_config(self):  # a vision-language config's language model
        return getattr(self.config, "text", self.config)

    def runner(self):
        return sv("model_runner").ModelRunner(self.ckpt, self.engine_config)


def make_ctx(meta: dict) -> Ctx:
    return Ctx(meta)


# ---- L0 -----------------------------------------------------------------------------------------------------

def probe_config(ctx, inp):
    cls = next(getattr(ctx.family, c) for c in ctx.family.__all__ if c.startswith(ctx.prefix) and c.endswith("Config"))
    config = cls.from_pretrained(ctx.ckpt) if hasattr(cls, "from_pretrained") else ctx.conversion.load_config(ctx.ckpt)
    return flat_config(config)


def probe_param_tree(ctx, inp):
    return layout_arrays(ctx.conversion.hf_layout(ctx.conversion.load_params(ctx.ckpt)))


def probe_importable(ctx, inp):
    return importable(inp["modules"])


# ---- L1 -----------------------------------------------------------------------------------------------------

def sampler_probe(op: str):
    def probe(ctx, inp):
        s, x = sv("sampler"), j(inp["logits"])
        if op == "penalties":
            return {"logits": np.asarray(s.apply_penalties(x, *(j(inp[k]) for k in (
                "prompt_ids_mask", "output_counts", "repetition_penalty", "presence_penalty", "frequency_penalty"))))}
        if op == "temperature":
            return {"logits": np.asarray(s.apply_temperature(x, j(inp["temperature"])))}
        if op == "min_p":
            return {"kept": np.asarray(jnp.isfinite(s.apply_min_p(x, j(inp["min_p"]))))}
        if op == "top_k_top_p":
            return {"kept": np.asarray(jnp.isfinite(s.apply_top_k_top_p(x, j(inp["top_k"]), j(inp["top_p"]))))}
        if op == "greedy":
            return {"ids": np.asarray(s.greedy_sample(x)).astype(np.int64)}
        return {"ids": np.asarray(s.random_sample(j(inp["probs"]), j(inp["noise"]))).astype(np.int64)}
    return probe


def probe_write_kv(ctx, inp):
    k, v = sv("paged_attention").write_to_kv_cache(*(j(inp[x]) for x in ("k_pages", "v_pages", "k_new", "v_new",
                                                                         "slot_mapping")))
    return {"k_pages": np.asarray(k), "v_pages": np.asarray(v)}


def _attention_args(inp):
    args = tuple(j(inp[k]) for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"))
    opts = dict(sm_scale=float(inp["sm_scale"]), sliding_window=int(inp["sliding_window"]) or None,
                soft_cap=float(inp["soft_cap"]) or None)
    return args, opts, (j(inp["sinks"]) if "sinks" in inp else None)


def _live(inp, out) -> np.ndarray:  # the rows of live tokens (padding rows are the caller's to ignore)
    return np.asarray(out)[: int(inp["cu_q_lens"][int(inp["num_seqs"][0])])]


def probe_paged_attention(ctx, inp):
    args, opts, sinks = _attention_args(inp)
    return {"out": _live(inp, sv("paged_attention").ragged_paged_attention(*args, **opts, sinks=sinks))}


def probe_paged_attention_kernel(ctx, inp):
    kernel = sv("kernels.ragged_paged_attention")
    args, opts, sinks = _attention_args(inp)
    # The Pallas body: compiled where a GPU is, interpreted as JAX ops elsewhere.
    extra = ({"interpret": jax.default_backend() != "gpu"}
             if "interpret" in inspect.signature(kernel.ragged_paged_attention).parameters else {})
    return {"reference": _live(inp, kernel.ragged_paged_attention_reference(*args, sinks, **opts)),
            "kernel": _live(inp, kernel.ragged_paged_attention(*args, sinks, **opts, **extra))}


def probe_rms_norm(ctx, inp):
    return {"y": np.asarray(ctx.lm.rms_norm(j(inp["x"]), j(inp["weight"]), ctx.lm_config.rms_norm_eps))}


def _inv_freqs(lm, config) -> dict:
    if "layer_type" in inspect.signature(lm.rope_inv_freq).parameters:
        return {lt: lm.rope_inv_freq(config, lt) for lt in sorted(set(config.layer_types))}
    return {"default": lm.rope_inv_freq(config)}


def probe_rope(ctx, inp):
    lm, c, out = ctx.lm, ctx.lm_config, {}
    factor = (lm.rope_attention_factor(c),) if hasattr(lm, "rope_attention_factor") else ()
    for lt, inv in _inv_freqs(lm, c).items():
        cos, sin = lm.rope_cos_sin(inv, j(inp["position_ids"]), *factor)
        out.update({f"{lt}.inv_freq": np.asarray(inv), f"{lt}.cos": np.asarray(cos), f"{lt}.sin": np.asarray(sin)})
    if "mrope_position_ids" in inp:
        mrope = importlib.import_module("jax_oracles.models.mrope")
        cos, sin = mrope.mrope_cos_sin(lm.rope_inv_freq(c), j(inp["mrope_position_ids"]), ctx.config.mrope_section,
                                       interleaved=False)
        out.update({"mrope.cos": np.asarray(cos), "mrope.sin": np.asarray(sin)})
    return out


def probe_moe_routing(ctx, inp):
    logits = j(inp["router_logits"])
    weights, idx = ctx.family.route(logits, ctx.config.num_experts_per_tok)
    rows = jnp.arange(logits.shape[0])[:, None]
    return {"routing": np.asarray(jnp.zeros(logits.shape, jnp.float32).at[rows, idx].set(weights))}


def probe_swiglu(ctx, inp):
    c = ctx.config
    return {"y": np.asarray(ctx.family.swiglu_clamped(j(inp["gate_up"]), c.swiglu_alpha, c.swiglu_limit))}


def probe_mxfp4(ctx, inp):
    values = ctx.conversion.dequantize_mxfp4(inp["blocks"].astype(np.uint8), inp["scales"].astype(np.uint8))
    return {"values": np.asarray(values, np.float32)}


# ---- L2 -----------------------------------------------------------------------------------------------------

def probe_decoder_layer(ctx, inp):
    pa, fn, out = sv("paged_attention"), ctx.serving.decoder_layer_paged, {}
    meta = pa.AttentionMetadata(**{k: j(inp[k]) for k in ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens",
                                                          "num_seqs")})
    live = int(inp["cu_q_lens"][-1])
    layers = sorted({int(k[5:].split(".")[0]) for k in inp if k.startswith("layer")})
    for i in layers:
        cache = pa.allocate_kv_cache(ctx.config, ctx.engine_config)
        ks, vs = list(cache.k), list(cache.v)
        ks[i], vs[i] = j(inp[f"layer{i}.k_pages"]), j(inp[f"layer{i}.v_pages"])
        cache = dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))
        ple = ([j(inp[f"layer{i}.per_layer_input"]) if f"layer{i}.per_layer_input" in inp else None]
               if "per_layer_input" in inspect.signature(fn).parameters else [])
        hidden, cache = fn(ctx.loaded[1], i, j(inp["hidden"]), *ple, j(inp["positions"]), cache, meta)
        out.update({f"layer{i}.k_pages": np.asarray(cache.k[i]), f"layer{i}.v_pages": np.asarray(cache.v[i]),
                    f"layer{i}.hidden": np.asarray(hidden)[:live]})
    return out


def probe_moe_block(ctx, inp):
    mlp = getattr(ctx.family, ctx.prefix + "MLP")(ctx.config)
    params = ctx.conversion.load_params(ctx.ckpt)["model"]["layers_0"]["mlp"]
    return {"y": np.asarray(mlp.apply({"params": params}, j(inp["x"])))}


# ---- L3 / L4 ------------------------------------------------------------------------------------------------

def probe_prefill(ctx, inp):
    return {"logits": np.asarray(ctx.runner().prefill_logits([int(x) for x in inp["token_ids"]]))}


def probe_prefill_image(ctx, inp):
    runner, image = ctx.runner(), inp["image"].astype(np.uint8)
    ids, fam = [int(x) for x in inp["token_ids"]], runner.family
    expanded, _, _ = runner.prepare_images(ids, [image])
    pixels, grid = fam.process_image(ctx.config, image)
    return {"prompt_token_ids": np.array(expanded, np.int64), "image_grid_thw": np.array(grid, np.int64),
            "pixel_values": np.asarray(pixels, np.float32),
            "image_rows": np.asarray(fam.embed_multimodal(ctx.loaded[1], pixels, grid)),
            "logits": np.asarray(runner.prefill_logits(ids, [image]))}


def probe_jit_static(ctx, inp):
    """Two one-token generations whose prompts fall in one bucket: the second compiles nothing."""
    engine, SP = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config), sv("config").SamplingParams
    counts = []
    for k in ("prompt_0", "prompt_1"):
        engine.generate([[int(x) for x in inp[k]]], SP(temperature=0.0, max_tokens=1))
        counts.append(int(engine.stats()["num_compilations"]))
    return {"recompilations": np.int64(counts[1] - counts[0])}


def probe_decode(ctx, inp):
    logits, snap = ctx.runner().teacher_forced_decode([int(x) for x in inp["prompt"]],
                                                      [int(x) for x in inp["continuation"]])
    return {**{"cache." + k: np.asarray(v) for k, v in snap.items()}, "logits": np.asarray(logits)}


# ---- L5 -----------------------------------------------------------------------------------------------------

def probe_engine(ctx, inp):
    return serve(sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config), sv("config").SamplingParams, inp)


# ---- the table: property name (no level) -> probe ------------------------------------------------------------

# every attention-feature suffix the torch side may name (window, softcap, sinks in that order)
_FEATURES = ("window", "softcap", "sinks")
_VARIANTS = ["".join(f"_{f}" for f in c) for r in range(4) for c in itertools.combinations(_FEATURES, r)]


def _arrays(probe):
    """The probe with numpy scalars in its result as 0-d arrays, as the torch side returns them."""
    return wraps(probe)(lambda ctx, inp: {k: np.asarray(v) for k, v in probe(ctx, inp).items()})


PROBES = {name: _arrays(fn) for name, fn in {
    "config": probe_config, "param_tree": probe_param_tree, "importable": probe_importable,
    **{f"sampler_{op}": sampler_probe(op) for op in ("penalties", "temperature", "min_p", "top_k_top_p", "greedy",
                                                     "random")},
    "write_to_kv_cache": probe_write_kv,
    **{f"paged_attention{v}": probe_paged_attention for v in _VARIANTS},
    **{f"paged_attention_kernel{v}": probe_paged_attention_kernel for v in _VARIANTS},
    "rms_norm": probe_rms_norm, "rope": probe_rope, "moe_routing": probe_moe_routing, "swiglu_clamped": probe_swiglu,
    "mxfp4_dequant": probe_mxfp4, "decoder_layer_paged": probe_decoder_layer, "moe_block": probe_moe_block,
    "prefill": probe_prefill, "prefill_image": probe_prefill_image, "jit_static": probe_jit_static,
    "decode_step": probe_decode, "engine_step": probe_engine,
}.items()}
