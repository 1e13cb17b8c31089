"""Run the serving-class checks on a candidate (the twin of recorder/probes/serving.py).

Runs inside the sandboxed child, reaching the candidate's serving_engine/, jax_oracles/ and conversion/
only through their public names.
"""
from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from catalog.family import language_model
from catalog.layout import layout_arrays
from catalog.trace import pressure_config, trace_arrays
from catalog.workloads import TOP_LOGPROBS, branch_params, dense_logprobs, long_decode_config, pad_rows, prompt_logprob_arrays, run_long_decode, run_stop_workload, sampled_params, stop_params, unpad_rows
from grader.probes.common import n, run_probes

jax.config.update("jax_default_matmul_precision", "highest")


def sv(name):
    return importlib.import_module(f"serving_engine.{name}")


class Ctx:
    def __init__(self, meta):
        task = meta["task"]
        self.ckpt = meta["assets"]["checkpoint"]
        fam = task["family"]
        modname = fam["model_module"][:-3].replace("/", ".")
        self.family = importlib.import_module(f"jax_oracles.{modname}")
        # the decoder's own module (a vision-language family names it: its operators are the language model's)
        self.lm_family = importlib.import_module(f"jax_oracles.{language_model(fam)[0][:-3].replace('/', '.')}")
        self.conversion = importlib.import_module(f"conversion.{modname.split('.')[-1]}")
        self.engine_config = sv("config").EngineConfig(**task["mode"]["engine"])
        self.workload = task["mode"]["workload"]
        self.prefix, self.layers = fam["model_prefix"], fam.get("layers", "model.layers")
        self._runner = None

    @property
    def layer0_params(self):
        """Params of decoder layer 0 (the family yaml's `layers` path: model.layers -> model/layers_0)."""
        *root, name = self.layers.split(".")
        tree = self.runner.model.params
        for key in (*root, f"{name}_0"):
            tree = tree[key]
        return tree

    @property
    def runner(self):
        if self._runner is None:
            self._runner = self.fresh_runner()
        return self._runner

    @property
    def config(self):
        return self.runner.model_config

    @property
    def lm_config(self):  # a vision-language config's language model
        return getattr(self.config, "text", self.config)

    @property
    def vocab(self):
        return self.config.vocab_size

    def fresh_runner(self):
        return sv("model_runner").ModelRunner(self.ckpt, self.engine_config)




# ---- L0 ----------------------------------------------------------------------------------------

def _missing(entries, resolve):
    missing = []
    for entry in entries:
        try:
            if resolve(str(entry)) is None:
                missing.append(str(entry))
        except (ImportError, AttributeError) as e:
            missing.append(f"{entry} ({type(e).__name__})")
    if missing:
        print("missing:", ", ".join(missing[:20]))
    return np.array(len(missing))


def _layout_entry(entry):
    path, name = entry.split(":")
    root = "jax_oracles" if path.startswith("models/") else "serving_engine"
    rel = path[len("serving/"):] if path.startswith("serving/") else path
    return getattr(importlib.import_module(f"{root}.{rel[:-3].replace('/', '.')}"), name, None)


def probe_layout(ctx, inp):
    return {"missing": _missing(inp["names"], _layout_entry)}


def probe_engine_api(ctx, inp):
    def resolve(entry):
        cls, meth = entry.split(".")
        mod = sv("engine") if cls == "LLMEngine" else sv("model_runner")
        return getattr(getattr(mod, cls), meth, None)
    return {"missing": _missing(inp["names"], resolve)}


def probe_param_tree(ctx, inp):
    return layout_arrays(ctx.conversion.hf_layout(ctx.conversion.load_params(ctx.ckpt)))


# ---- L1 ----------------------------------------------------------------------------------------

def probe_paged_attention(ctx, inp, impl="auto"):
    window, cap = int(inp["sliding_window"]) or None, float(inp["soft_cap"]) or None
    out = sv("paged_attention").ragged_paged_attention(
        *(jnp.asarray(inp[k]) for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens",
                                        "num_seqs")),
        sm_scale=float(inp["sm_scale"]), sliding_window=window, soft_cap=cap,
        sinks=jnp.asarray(inp["sinks"]) if "sinks" in inp else None, impl=impl)
    return {"out": n(out)[: int(inp["cu_q_lens"][-1])]}


def probe_paged_attention_kernel(ctx, inp):
    # The Pallas kernel body: compiled where a GPU is, run as JAX ops (interpret mode) on a CPU, so the
    # kernel is graded on every machine, not only on GPUs.
    return probe_paged_attention(ctx, inp, impl="kernel" if jax.default_backend() == "gpu" else "interpret")


def probe_rope(ctx, inp):
    f, c = ctx.lm_family, ctx.lm_config
    pos = jnp.asarray(inp["position_ids"])
    if "layer_type" in inspect.signature(f.rope_inv_freq).parameters:
        invs = {lt: f.rope_inv_freq(c, lt) for lt in sorted(set(c.layer_types))}
    else:
        invs = {"default": f.rope_inv_freq(c)}
    out = {}
    for lt, inv in invs.items():
        cos, sin = f.rope_cos_sin(inv, pos)
        out.update({f"{lt}.inv_freq": n(inv), f"{lt}.cos": n(cos), f"{lt}.sin": n(sin)})
    if hasattr(f, "rope_attention_factor"):  # YaRN scales cos and sin by it
        out["attention_factor"] = np.float32(f.rope_attention_factor(c))
    return out


def probe_moe_routing(ctx, inp):
    logits = jnp.asarray(inp["router_logits"])
    weights, idx = ctx.family.route(logits, ctx.config.num_experts_per_tok)
    rows = jnp.arange(logits.shape[0])[:, None]
    return {"routing": n(jnp.zeros(logits.shape, jnp.float32).at[rows, idx].set(weights))}


def probe_expert_activation(ctx, inp):
    c = ctx.config
    return {"y": n(ctx.family.swiglu_clamped(jnp.asarray(inp["gate_up"]), c.swiglu_alpha, c.swiglu_limit))}


def probe_mxfp4_dequant(ctx, inp):
    dequantize = ctx.conversion.dequantize_mxfp4
    return {"values": np.asarray(dequantize(inp["blocks"], inp["scales"]), np.float32),
            "layer0": np.asarray(dequantize(inp["layer0_blocks"], inp["layer0_scales"]), np.float32)}


def probe_moe_block(ctx, inp):
    mlp = getattr(ctx.family, ctx.prefix + "MLP")(ctx.config)
    return {"y": n(mlp.apply({"params": ctx.layer0_params["mlp"]}, jnp.asarray(inp["x"])))}


def probe_norm(ctx, inp):
    return {"y": n(ctx.lm_family.rms_norm(jnp.asarray(inp["x"]), jnp.asarray(inp["weight"]),
                                          ctx.lm_config.rms_norm_eps))}


def _sampler_probe(which):
    def probe(ctx, inp):
        s = sv("sampler")
        x = jnp.asarray(inp["logits"])
        j = {k: jnp.asarray(v) for k, v in inp.items()}
        if which == "penalties":
            return {"logits": n(s.apply_penalties(x, j["prompt_ids_mask"], j["output_counts"],
                                                  j["repetition_penalty"], j["presence_penalty"],
                                                  j["frequency_penalty"]))}
        if which == "temperature":
            return {"logits": n(s.apply_temperature(x, j["temperature"]))}
        if which == "min_p":
            return {"kept": n(jnp.isfinite(s.apply_min_p(x, j["min_p"]))).astype(np.int64)}
        if which == "top_k_top_p":
            return {"kept": n(jnp.isfinite(s.apply_top_k_top_p(x, j["top_k"], j["top_p"]))).astype(np.int64)}
        if which == "greedy":
            return {"ids": n(s.greedy_sample(x)).astype(np.int64)}
        y = s.apply_top_k_top_p(s.apply_min_p(s.apply_temperature(x, j["temperature"]), j["min_p"]),
                                j["top_k"], j["top_p"])
        return {"ids": n(s.random_sample(jax.nn.softmax(y, -1), j["noise"])).astype(np.int64)}
    return probe


def _pipeline_requests(inp):
    """The recorded rows as the candidate's own requests (`request_id` "pipe-k"; seed -1 = unseeded)."""
    SP, Request = sv("config").SamplingParams, sv("request").Request
    reqs = []
    for k, seed in enumerate(np.asarray(inp["seed"])):
        params = SP(temperature=float(inp["temperature"][k]), top_k=int(inp["top_k"][k]),
                    top_p=float(inp["top_p"][k]), min_p=float(inp["min_p"][k]),
                    repetition_penalty=float(inp["repetition_penalty"][k]),
                    presence_penalty=float(inp["presence_penalty"][k]),
                    frequency_penalty=float(inp["frequency_penalty"][k]), seed=None if seed < 0 else int(seed))
        req = Request(f"pipe-{k}", unpad_rows(inp["prompt_token_ids"][k:k + 1])[0], params)
        req.output_token_ids = unpad_rows(inp["output_token_ids"][k:k + 1])[0]
        reqs.append(req)
    return reqs


def probe_sampler_pipeline(ctx, inp):
    s = sv("sampler")
    # The vocabulary is the logits' width, not the model config's: a sampler check must not depend on the
    # candidate's checkpoint loading.
    meta = s.SamplingMetadata.from_requests(_pipeline_requests(inp), inp["logits"].shape[-1])
    ids, _ = s.Sampler()(jnp.asarray(inp["logits"]), meta)
    return {"ids": n(ids).astype(np.int64)}


# ---- L2-L4 -------------------------------------------------------------------------------------

def probe_decoder_layer_paged(ctx, inp):
    pa, runner = sv("paged_attention"), ctx.fresh_runner()
    T = inp["hidden"].shape[0]
    table = jnp.asarray(inp["page_indices"])
    meta = pa.AttentionMetadata(slot_mapping=jnp.asarray(inp["slot_mapping"]), kv_lens=jnp.asarray(inp["kv_lens"]),
                                page_indices=table, cu_q_lens=jnp.asarray(inp["cu_q_lens"]),
                                num_seqs=jnp.asarray(inp["num_seqs"]))
    fn = runner.family.decoder_layer_paged
    args = [runner.model, 0, jnp.asarray(inp["hidden"])]
    if "per_layer_input" in inspect.signature(fn).parameters:
        args.append(jnp.asarray(inp["per_layer_input"]))
    out, cache = fn(*args, jnp.asarray(inp["positions"]), runner.kv_cache, meta)
    k = cache.k[0][table[0]].reshape(-1, *cache.k[0].shape[2:])[:T]
    v = cache.v[0][table[0]].reshape(-1, *cache.v[0].shape[2:])[:T]
    return {"hidden": n(out), "k_written": n(k), "v_written": n(v)}


def probe_prefill(ctx, inp):
    return {"logits": n(ctx.fresh_runner().prefill_logits([int(x) for x in inp["token_ids"]]))}


def probe_decode_logits(ctx, inp):
    logits, _ = ctx.fresh_runner().teacher_forced_decode(inp["prompt"].tolist(), inp["continuation"].tolist())
    return {"logits": n(logits)}


def probe_cache_state(ctx, inp):
    _, snap = ctx.fresh_runner().teacher_forced_decode(inp["prompt"].tolist(), inp["continuation"].tolist())
    return {k.replace(".", "_"): np.asarray(v) for k, v in sorted(snap.items())}


# ---- L5 / L6 -----------------------------------------------------------------------------------

def _generate(ctx, inp, sampled):
    SP, w = sv("config").SamplingParams, ctx.workload
    prompts = unpad_rows(inp["prompts"])
    params = (sampled_params(SP, len(prompts), w["max_tokens"]) if sampled else
              [SP(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)] * len(prompts))
    engine = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config)
    outs = engine.generate(prompts, params)
    return outs, engine.stats()


def probe_greedy_sequences(ctx, inp):
    outs, _ = _generate(ctx, inp, sampled=False)
    return {"output_ids": pad_rows([o.output_token_ids for o in outs], ctx.workload["max_tokens"])}


def probe_sampled_sequences(ctx, inp):
    outs, _ = _generate(ctx, inp, sampled=True)
    return {"output_ids": pad_rows([o.output_token_ids for o in outs], ctx.workload["max_tokens"])}


def probe_engine_invariants(ctx, inp):
    _, stats = _generate(ctx, inp, sampled=False)
    return {"prefix_hit_blocks": np.array(stats["num_prefix_hit_blocks"], np.int64),
            "free_blocks_after": np.array(stats["num_free_blocks"], np.int64),
            "num_blocks": np.array(stats["num_blocks"], np.int64)}


def probe_schedule_trace(ctx, inp):
    # the mode's engine under pressure, the candidate's own trace (recorder/probes/serving.py is the twin)
    config = pressure_config(ctx.engine_config, inp["num_blocks"], inp["long_prefill_token_threshold"])
    engine = sv("engine").LLMEngine(ctx.ckpt, config)
    engine.generate(unpad_rows(inp["prompts"]), sv("config").SamplingParams(
        temperature=0.0, max_tokens=ctx.workload["max_tokens"], ignore_eos=True))
    return trace_arrays(engine.scheduler.trace, config.max_num_seqs, config.max_blocks_per_seq, config.num_blocks)


def probe_stop_conditions(ctx, inp):
    engine = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config,
                                    override_generation_config={"eos_token_id": inp["eos_token_ids"].tolist()})
    return run_stop_workload(engine, unpad_rows(inp["prompts"]), stop_params(sv("config").SamplingParams, inp),
                             inp["abort_after"])


def probe_sampling_branches(ctx, inp):
    prompts, out = unpad_rows(inp["prompts"]), {}
    for name, params in branch_params(sv("config").SamplingParams, len(prompts), ctx.workload["max_tokens"]).items():
        outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(prompts, params)
        out[name] = pad_rows([o.output_token_ids for o in outs], ctx.workload["max_tokens"])
    return out


def probe_long_decode(ctx, inp):
    engine = sv("engine").LLMEngine(ctx.ckpt, long_decode_config(ctx.engine_config))
    return run_long_decode(engine, unpad_rows(inp["prompts"]), sv("config").SamplingParams,
                           ctx.engine_config.max_model_len)


def _prompts_of(inp):
    return [[int(x) for x in inp[f"prompt_{i}"]] for i in range(len([k for k in inp if k.startswith("prompt_")]))]


def probe_heldout_logprobs(ctx, inp):
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        _prompts_of(inp), sv("config").SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS))
    out = {}
    for i, o in enumerate(outs):
        out[f"prompt_{i}"], out[f"top_{i}"] = prompt_logprob_arrays(o, TOP_LOGPROBS)
    return out


def probe_next_token_dists(ctx, inp):
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        _prompts_of(inp), sv("config").SamplingParams(temperature=0.0, max_tokens=ctx.workload["max_tokens"],
                                                      ignore_eos=True, logprobs=-1))
    return {f"logprobs_{i}": dense_logprobs(o.logprobs, ctx.vocab) for i, o in enumerate(outs)}


PROBES = {
    "layout": probe_layout, "engine_api": probe_engine_api, "param_tree": probe_param_tree,
    "paged_attention": probe_paged_attention, "paged_attention_window_softcap": probe_paged_attention,
    "paged_attention_kernel": probe_paged_attention_kernel,
    "paged_attention_kernel_window_softcap": probe_paged_attention_kernel,
    "paged_attention_sinks": probe_paged_attention, "paged_attention_kernel_sinks": probe_paged_attention_kernel,
    "rope": probe_rope, "norm": probe_norm, "moe_routing": probe_moe_routing,
    "expert_activation": probe_expert_activation, "mxfp4_dequant": probe_mxfp4_dequant, "moe_block": probe_moe_block,
    **{f"sampler_{w}": _sampler_probe(w) for w in ("penalties", "temperature", "min_p", "top_k_top_p",
                                                   "greedy", "random")},
    "sampler_pipeline": probe_sampler_pipeline,
    "decoder_layer_paged": probe_decoder_layer_paged,
    "prefill_t5": probe_prefill, "prefill_t17": probe_prefill, "prefill_t40": probe_prefill,
    "decode_logits": probe_decode_logits, "cache_state": probe_cache_state,
    "greedy_sequences": probe_greedy_sequences, "sampled_sequences": probe_sampled_sequences,
    "engine_invariants": probe_engine_invariants, "schedule_trace": probe_schedule_trace,
    "stop_conditions": probe_stop_conditions, "sampling_branches": probe_sampling_branches,
    "long_decode": probe_long_decode, "heldout_logprobs": probe_heldout_logprobs, "next_token_dists": probe_next_token_dists,
}


PROBES.update(importlib.import_module("grader.probes.serving_vision").PROBES)  # picked by feature tags


def main(inputs_path, outputs_path):
    run_probes(inputs_path, outputs_path, Ctx, PROBES)
