"""Record every check of the serving class (levels L0-L6) from the pure-PyTorch vLLM-style engine.

Inputs come from numpy (seeded by check name); the JAX twin is grader/probes/serving.py.
"""
from __future__ import annotations

import importlib
import inspect
import time

import numpy as np
import torch

from catalog.checks import checks_for
from catalog.family import language_model
from catalog.layout import layout_arrays
from catalog.provenance import checkpoint_dir
from catalog.trace import pressure_config, trace_arrays
from catalog.workloads import FINISH_CODES, TOP_LOGPROBS, branch_params, dense_logprobs, long_decode_config, pad_rows, prompt_logprob_arrays, run_long_decode, run_stop_workload, sampled_params, stop_params
from recorder.probes import run_probes
from recorder.probes.training import ROOT, checkpoint_layout, n, public_names, rng_for, t
from torch_sources.models.loading import load_config
from torch_sources.models.mxfp4 import dequantize_mxfp4

SERVING_MODULES = ("serving/config.py", "serving/request.py", "serving/block_pool.py",
                   "serving/kv_cache_manager.py", "serving/encoder_cache_manager.py", "serving/scheduler.py",
                   "serving/input_batch.py", "serving/multimodal.py", "serving/paged_attention.py",
                   "serving/sampler.py", "serving/model_runner.py", "serving/engine.py")
ENGINE_API = ("LLMEngine.add_request", "LLMEngine.abort_request", "LLMEngine.step", "LLMEngine.generate",
              "LLMEngine.get_num_unfinished_requests", "LLMEngine.stats", "ModelRunner.prefill_logits", "ModelRunner.teacher_forced_decode")
PROMPT_LENS = {"prefill_t5": 5, "prefill_t17": 17, "prefill_t40": 40}
HELDOUT_LENS = (12, 25, 14)  # 25 > the chunked budget: prompt logprobs across chunks


def sv(name):
    return importlib.import_module(f"torch_sources.serving.{name}")


class Ctx:
    def __init__(self, cfg):
        torch.set_num_threads(1)  # eager small-batch decode: threads cost more than they give on 2 cores
        self.cfg = cfg
        self.ckpt = checkpoint_dir(cfg)  # checkpoint=PATH, else the family's
        self.family = importlib.import_module("torch_sources." + cfg.family.model_module[:-3].replace("/", "."))
        # the decoder's own module (a vision-language family names it: its operators are the language model's)
        self.lm_family = importlib.import_module("torch_sources." + language_model(cfg.family)[0][:-3].replace("/", "."))
        self.engine_config = sv("config").EngineConfig(**dict(cfg.mode.engine))
        self.runner = sv("model_runner").ModelRunner(self.ckpt, self.engine_config)
        self.config = self.runner.model_config
        self.lm_config = getattr(self.config, "text", self.config)  # a vision-language config's language model
        self.vocab = self.config.vocab_size
        self.prompt_vocab = prompt_vocab(self.ckpt, self.vocab, cfg.family.features)
        self.wall = None  # set by the L5 workload probe

    def fresh_runner(self):
        return sv("model_runner").ModelRunner(self.ckpt, self.engine_config)


def prompt_vocab(ckpt, vocab: int, features) -> int:
    """The token ids random prompts draw below: the vocabulary, except that a vision-language family's special
    tokens (image pads, video pads: every *_token_id of its config.json, all past the text ids) stay out of text
    prompts, where the engine would refuse them or place nothing."""
    if "vision:qwen" not in features:
        return vocab
    d = load_config(ckpt)
    return min(int(v) for k, v in d.items() if k.endswith("_token_id") and isinstance(v, int))


def workload(cfg, vocab: int, name: str = "workload"):
    """Prompts of the mode's workload. With shared_prefix, most prompts start with the same tokens. The
    second prompt holds two full blocks after a block of its own; the last prompt starts with them. Equal
    blocks after different prefixes must never share KV: the prefix-cache lookup walks from the first block,
    so only a chain that leaves out the prefix would let the last prompt hit the second's blocks."""
    w, r = cfg.mode.workload, rng_for(f"{cfg.task_name}/{name}")
    lo, hi = w.prompt_len
    bs = cfg.mode.engine.block_size
    prefix = list(r.integers(3, vocab, w.shared_prefix)) if w.shared_prefix else []
    middle = list(r.integers(3, vocab, 2 * bs))
    prompts = []
    for i in range(w.num_requests):
        body = list(r.integers(3, vocab, int(r.integers(lo, hi + 1))))
        if i == 1:
            body = list(r.integers(3, vocab, bs)) + middle + body[:bs]
        elif i == w.num_requests - 1:
            body = middle + body[:bs]
        elif prefix and i % 4 != 3:
            body = prefix + body
        prompts.append([int(x) for x in body])
    return prompts



# ---- L0 ----------------------------------------------------------------------------------------

def probe_layout(ctx):
    mods = [ctx.cfg.family.model_module, f"serving/models/{ctx.cfg.family.name}.py", *SERVING_MODULES]
    names = [f"{m}:{name}" for m in mods for name in public_names(ROOT / "torch_sources" / m)]
    return {"names": np.array(names)}, {"missing": np.array(0)}


def probe_engine_api(ctx):
    return {"names": np.array(ENGINE_API)}, {"missing": np.array(0)}


def probe_param_tree(ctx):
    """The checkpoint's tensors the model reads, by HF name and shape. A multimodal release (Gemma 4) keeps its
    language model under `model.language_model.*` beside vision/audio towers: the family's `text_state_dict`
    names those tensors as the text model's (towers skipped), the names a converter's hf_layout reports."""
    layout = checkpoint_layout(ctx.ckpt)
    text_names = getattr(ctx.family, "text_state_dict", None)
    if text_names is not None:
        layout = text_names(ctx.config, layout)
    return {}, layout_arrays(layout)


# ---- L1 ----------------------------------------------------------------------------------------

def _ragged_case(name, K, H, window=None, cap=None, long=False, sinks=False):
    """Prefill, decode, chunk after context, decode in one ragged batch. `long`: contexts past the kernel's
    64-key blocks, so a flash-style kernel takes several online-softmax steps per query block. `sinks`: one
    sink logit per query head, some above every score (the sink takes most of the weight), some below."""
    r = rng_for(name)
    S, N = 4, 2 * K
    if long:
        q_lens, kv_lens, pages_per_seq, P, T = [5, 1, 12, 1], [5, 90, 140, 20], 36, 150, 32
    else:
        q_lens, kv_lens, pages_per_seq, P, T = [5, 1, 3, 1], [5, 9, 14, 4], 4, 24, 16  # T: padded token bucket
    table = r.permutation(P)[: 4 * pages_per_seq].reshape(4, pages_per_seq).astype(np.int32)
    q = r.standard_normal((T, N, H), np.float32)
    k = r.standard_normal((P, S, K, H), np.float32)
    v = r.standard_normal((P, S, K, H), np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    case = {"q": q, "k_pages": k, "v_pages": v, "kv_lens": np.array(kv_lens, np.int32), "page_indices": table,
            "cu_q_lens": cu, "num_seqs": np.array([4], np.int32), "sm_scale": np.float32(H ** -0.5),
            "sliding_window": np.int32(window or 0), "soft_cap": np.float32(cap or 0.0)}
    if sinks:
        case["sinks"] = (r.standard_normal(N) * 2 + np.array([3.0, -2.0] * K)).astype(np.float32)
    return case


def _attention_probe(name, window=None, cap=None, long=False, sinks=False):
    def probe(ctx):
        inp = _ragged_case(name, 2, 16, window, cap, long, sinks)
        out = sv("paged_attention").ragged_paged_attention(
            *(t(inp[k]) for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")),
            sm_scale=float(inp["sm_scale"]), sliding_window=window, soft_cap=cap,
            sinks=t(inp["sinks"]) if sinks else None)
        used = int(inp["cu_q_lens"][-1])
        return inp, {"out": n(out)[:used]}
    return probe


def _inv_freqs(family, config):
    sig = inspect.signature(family.rope_inv_freq).parameters
    if "layer_type" in sig:
        return {lt: family.rope_inv_freq(config, lt) for lt in sorted(set(config.layer_types))}
    return {"default": family.rope_inv_freq(config)}


def probe_rope(ctx):
    pos = np.array([[0, 1, 2, 7, 8, 63, 64, 100]], np.int32)
    out = {}
    for lt, inv in _inv_freqs(ctx.lm_family, ctx.lm_config).items():
        cos, sin = ctx.lm_family.rope_cos_sin(inv, t(pos))
        out.update({f"{lt}.inv_freq": n(inv), f"{lt}.cos": n(cos), f"{lt}.sin": n(sin)})
    if hasattr(ctx.lm_family, "rope_attention_factor"):  # YaRN scales cos and sin by it
        out["attention_factor"] = np.float32(ctx.lm_family.rope_attention_factor(ctx.lm_config))
    return {"position_ids": pos}, out


def probe_moe_routing(ctx):
    """Router logits of 16 tokens, some with ties (all equal, inside the top k, across its boundary) ->
    each token's routing weights scattered over the experts (0 where not selected)."""
    r, E, k = rng_for("moe_routing"), ctx.config.num_local_experts, ctx.config.num_experts_per_tok
    logits = (r.standard_normal((16, E)) * 2).astype(np.float32)
    logits[3] = logits[3, 0]  # every expert tied
    logits[5, 1] = logits[5, 2] = logits[5].max() + 1  # a tie inside the top k
    logits[7] = np.linspace(1.0, -1.0, E, dtype=np.float32)
    logits[7, k] = logits[7, k - 1]  # a tie across the k-th place: the index rule decides
    weights, idx = ctx.family.route(t(logits), k)
    dense = torch.zeros(16, E).scatter_(1, idx.long(), weights)
    return {"router_logits": logits}, {"routing": n(dense)}


def probe_expert_activation(ctx):
    r, c = rng_for("expert_activation"), ctx.config
    gate_up = (r.standard_normal((8, 2 * c.intermediate_size)) * 5).astype(np.float32)  # |x| > limit 7 often
    return {"gate_up": gate_up}, {"y": n(ctx.family.swiglu_clamped(t(gate_up), c.swiglu_alpha, c.swiglu_limit))}


def probe_mxfp4_dequant(ctx):
    """Every byte (both nibbles) under scales from 2^-9 to 2^8, then layer 0's stored down_proj experts."""
    from safetensors.numpy import load_file


    blocks = np.arange(256, dtype=np.uint8).reshape(8, 2, 16)
    scales = (118 + np.arange(16, dtype=np.uint8)).reshape(8, 2)
    state = load_file(str(ctx.ckpt / "model.safetensors"))
    inp = {"blocks": blocks, "scales": scales,
           "layer0_blocks": state["model.layers.0.mlp.experts.down_proj_blocks"],
           "layer0_scales": state["model.layers.0.mlp.experts.down_proj_scales"]}
    return inp, {"values": n(dequantize_mxfp4(t(blocks), t(scales))),
                 "layer0": n(dequantize_mxfp4(t(inp["layer0_blocks"]), t(inp["layer0_scales"])))}


def probe_norm(ctx):
    r = rng_for("norm")
    D = ctx.config.hidden_size
    x, w = r.standard_normal((3, D), np.float32) * 2, (1 + 0.1 * r.standard_normal(D)).astype(np.float32)
    return {"x": x, "weight": w}, {"y": n(ctx.lm_family.rms_norm(t(x), t(w), ctx.lm_config.rms_norm_eps))}


def _sampler_case(ctx):
    r = rng_for("sampler")
    B, V = 4, ctx.vocab
    logits = (r.standard_normal((B, V)) * 3).astype(np.float32)
    prompt_mask = r.random((B, V)) < 0.05
    # Outputs long enough to hold a third of the vocabulary, and penalties large enough that a wrong sign or
    # a dropped term moves the logits well past the strict bar (the penalties act on seen tokens only).
    counts = (r.random((B, V)) < 0.3).astype(np.int32) * r.integers(1, 4, (B, V)).astype(np.int32)
    return {"logits": logits, "prompt_ids_mask": prompt_mask, "output_counts": counts,
            "repetition_penalty": np.array([1.0, 1.2, 1.5, 0.9], np.float32),
            "presence_penalty": np.array([0.0, 1.5, 0.0, 2.0], np.float32),
            "frequency_penalty": np.array([0.0, 0.4, 0.8, 0.0], np.float32),
            "temperature": np.array([0.0, 0.7, 1.0, 1.3], np.float32),
            "min_p": np.array([0.0, 0.05, 0.1, 0.0], np.float32),
            "top_k": np.array([0, 5, 50, 1], np.int32), "top_p": np.array([1.0, 0.9, 0.5, 0.8], np.float32),
            "noise": np.stack([sv("sampler").exponential_noise(7, i, V) for i in range(B)])}


def _sampler_probe(which):
    def probe(ctx):
        s, inp = sv("sampler"), _sampler_case(ctx)
        x = t(inp["logits"])
        if which == "penalties":
            y = s.apply_penalties(x, t(inp["prompt_ids_mask"]), t(inp["output_counts"]),
                                  t(inp["repetition_penalty"]), t(inp["presence_penalty"]),
                                  t(inp["frequency_penalty"]))
        elif which == "temperature":
            y = s.apply_temperature(x, t(inp["temperature"]))
        elif which == "min_p":  # masks with -inf: compare the kept set
            return inp, {"kept": n(torch.isfinite(s.apply_min_p(x, t(inp["min_p"])))).astype(np.int64)}
        elif which == "top_k_top_p":
            y = s.apply_top_k_top_p(x, t(inp["top_k"]), t(inp["top_p"]))
            return inp, {"kept": n(torch.isfinite(y)).astype(np.int64)}
        elif which == "greedy":
            return inp, {"ids": n(s.greedy_sample(x)).astype(np.int64)}
        else:  # random_sample on the fully transformed row
            y = s.apply_top_k_top_p(s.apply_min_p(s.apply_temperature(x, t(inp["temperature"])),
                                                  t(inp["min_p"])), t(inp["top_k"]), t(inp["top_p"]))
            ids = s.random_sample(torch.softmax(y, -1), t(inp["noise"]))
            return inp, {"ids": n(ids).astype(np.int64)}
        return inp, {"logits": n(y)}
    return probe


# Settings where the pipeline's order shows: a large min-p after a high temperature keeps far more
# tokens than before it; top-k and top-p over penalised logits; some rows greedy, some unseeded.
PIPELINE_PARAMS = (
    dict(temperature=2.0, min_p=0.3), dict(temperature=2.5, min_p=0.5),
    dict(temperature=1.8, min_p=0.2, top_k=40), dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=1.5, top_p=0.6, min_p=0.1), dict(temperature=0.5, min_p=0.4),
    dict(temperature=1.2, top_k=8, top_p=0.7, repetition_penalty=1.3),
    dict(temperature=2.0, min_p=0.25, presence_penalty=0.8, frequency_penalty=0.4),
)


def _sampler_pipeline_case(ctx):
    """32 rows (8 settings x 4 output lengths, so 4 noise steps each); prompt/output ids padded with -1."""
    r, V = rng_for("sampler_pipeline"), ctx.vocab
    rows = [(i, params, steps) for steps in range(4) for i, params in enumerate(PIPELINE_PARAMS)]
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")
    neutral = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0)
    col = {k: np.array([{**neutral, **p}[k] for _, p, _ in rows], np.int32 if k == "top_k" else np.float32)
           for k in names}
    logits = (r.standard_normal((len(rows), V)) * 2.5).astype(np.float32)
    # Each prompt holds its row's top token, so a penalty can move even a greedy row's argmax.
    prompts = [r.integers(0, V, int(r.integers(3, 12))).tolist() + [int(row.argmax())] for row in logits]
    outputs = [r.integers(0, V, 2 * s + int(r.integers(0, 2))).tolist() for _, _, s in rows]
    seeds = np.array([-1 if i % 3 == 0 else 1000 + 17 * k for k, (i, _, _) in enumerate(rows)], np.int64)
    return {"logits": logits, **col, "seed": seeds, "prompt_token_ids": pad_rows(prompts, 12),
            "output_token_ids": pad_rows(outputs, 8)}


def _pipeline_requests(inp, sampling_params_cls, request_cls):
    """The case's rows as serving requests (`request_id` "pipe-k"; seed -1 = unseeded)."""
    reqs = []
    for k, seed in enumerate(np.asarray(inp["seed"])):
        params = sampling_params_cls(
            temperature=float(inp["temperature"][k]), top_k=int(inp["top_k"][k]), top_p=float(inp["top_p"][k]),
            min_p=float(inp["min_p"][k]), repetition_penalty=float(inp["repetition_penalty"][k]),
            presence_penalty=float(inp["presence_penalty"][k]), frequency_penalty=float(inp["frequency_penalty"][k]),
            seed=None if seed < 0 else int(seed))
        req = request_cls(f"pipe-{k}", [int(x) for x in inp["prompt_token_ids"][k] if x >= 0], params)
        req.output_token_ids = [int(x) for x in inp["output_token_ids"][k] if x >= 0]
        reqs.append(req)
    return reqs


def probe_sampler_pipeline(ctx):
    """The engine's own Sampler over SamplingMetadata.from_requests: the order of its stages, its noise."""
    inp = _sampler_pipeline_case(ctx)
    s = sv("sampler")
    reqs = _pipeline_requests(inp, sv("config").SamplingParams, sv("request").Request)
    ids, _ = s.Sampler()(t(inp["logits"]), s.SamplingMetadata.from_requests(reqs, ctx.vocab))
    return inp, {"ids": n(ids).astype(np.int64)}


# ---- L2 ----------------------------------------------------------------------------------------

def probe_decoder_layer_paged(ctx):
    r, c = rng_for("decoder_layer_paged"), ctx.config
    pa, runner = sv("paged_attention"), ctx.fresh_runner()
    T, S = 11, ctx.engine_config.block_size
    table = r.permutation(ctx.engine_config.num_blocks)[: -(-T // S)].astype(np.int32)
    slots = np.array([table[i // S] * S + i % S for i in range(T)], np.int32)
    hidden = r.standard_normal((T, c.hidden_size), np.float32)
    positions = np.arange(T, dtype=np.int32)
    if "pos:mrope" in ctx.cfg.family.features:  # three rows apart, so each M-RoPE section's row shows
        positions = np.sort(r.integers(0, 2 * T, (3, T)), axis=1).astype(np.int32)
    inp = {"hidden": hidden, "positions": positions, "slot_mapping": slots,
           "page_indices": table[None], "kv_lens": np.array([T], np.int32),
           "cu_q_lens": np.array([0, T], np.int32), "num_seqs": np.array([1], np.int32)}
    meta = pa.AttentionMetadata(slot_mapping=t(slots), kv_lens=t(inp["kv_lens"]), page_indices=t(table[None]),
                                cu_q_lens=t(inp["cu_q_lens"]), num_seqs=t(inp["num_seqs"]))
    fn = runner.family.decoder_layer_paged
    args = [runner.model, 0, t(hidden)]
    if "per_layer_input" in inspect.signature(fn).parameters:
        ple = r.standard_normal((T, c.hidden_size_per_layer_input), np.float32)
        inp["per_layer_input"] = ple
        args.append(t(ple))
    out, cache = fn(*args, t(inp["positions"]), runner.kv_cache, meta)
    k = cache.k[0][t(table).long()].reshape(-1, *cache.k[0].shape[2:])[:T]
    v = cache.v[0][t(table).long()].reshape(-1, *cache.v[0].shape[2:])[:T]
    return inp, {"hidden": n(out), "k_written": n(k), "v_written": n(v)}


def _layer0(model, layers_path: str):
    for name in layers_path.split("."):
        model = getattr(model, name)
    return model[0]


def probe_moe_block(ctx):
    r, c = rng_for("moe_block"), ctx.config
    x = (r.standard_normal((1, 12, c.hidden_size)) * 2).astype(np.float32)
    with torch.no_grad():
        y = _layer0(ctx.runner.model, ctx.cfg.family.layers).mlp(t(x))
    return {"x": x}, {"y": n(y)}


# ---- L3 / L4 -----------------------------------------------------------------------------------

def _prompt(name, vocab, length):
    return rng_for(name).integers(3, vocab, length).astype(np.int32)


def _prefill_probe(name):
    def probe(ctx):
        ids = _prompt(name, ctx.prompt_vocab, PROMPT_LENS[name])
        return {"token_ids": ids}, {"logits": n(ctx.fresh_runner().prefill_logits(ids.tolist()))}
    return probe


def probe_teacher_forced(ctx):
    prompt, cont = _prompt("tf_prompt", ctx.prompt_vocab, 11), _prompt("tf_cont", ctx.prompt_vocab, 8)
    logits, snap = ctx.fresh_runner().teacher_forced_decode(prompt.tolist(), cont.tolist())
    return {"prompt": prompt, "continuation": cont}, {"logits": n(logits)}


def probe_cache_state(ctx):
    prompt, cont = _prompt("tf_prompt", ctx.prompt_vocab, 11), _prompt("tf_cont", ctx.prompt_vocab, 8)
    _, snap = ctx.fresh_runner().teacher_forced_decode(prompt.tolist(), cont.tolist())
    return {"prompt": prompt, "continuation": cont}, {k.replace(".", "_"): v for k, v in sorted(snap.items())}


# ---- L5 / L6 -----------------------------------------------------------------------------------

def run_workload(ctx, sampled: bool):
    cfg, SP = ctx.cfg, sv("config").SamplingParams
    prompts = workload(cfg, ctx.prompt_vocab)
    w = cfg.mode.workload
    params = (sampled_params(SP, len(prompts), w.max_tokens) if sampled else
              [SP(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)] * len(prompts))
    engine = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config)
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    stats = engine.stats()
    return prompts, outs, stats, wall


def probe_greedy_sequences(ctx):
    prompts, outs, stats, wall = run_workload(ctx, sampled=False)
    ctx.wall = wall
    return ({"prompts": pad_rows(prompts, max(map(len, prompts)))},
            {"output_ids": pad_rows([o.output_token_ids for o in outs], ctx.cfg.mode.workload.max_tokens)})


def probe_sampled_sequences(ctx):
    prompts, outs, _, _ = run_workload(ctx, sampled=True)
    return ({"prompts": pad_rows(prompts, max(map(len, prompts)))},
            {"output_ids": pad_rows([o.output_token_ids for o in outs], ctx.cfg.mode.workload.max_tokens)})


def probe_engine_invariants(ctx):
    prompts, _, stats, _ = run_workload(ctx, sampled=False)
    return {"prompts": pad_rows(prompts, max(map(len, prompts)))}, {"prefix_hit_blocks": np.array(stats["num_prefix_hit_blocks"], np.int64),
                "free_blocks_after": np.array(stats["num_free_blocks"], np.int64),
                "num_blocks": np.array(stats["num_blocks"], np.int64)}


def probe_schedule_trace(ctx):
    """The scheduler at work under pressure: per step, what ran, what was preempted, the block tables and
    the blocks freed and evicted. Refuses a workload that never evicts (or, beyond core mode, never preempts)."""
    prompts = workload(ctx.cfg, ctx.prompt_vocab)
    pressure = ctx.cfg.mode.pressure
    config = pressure_config(ctx.engine_config, pressure.num_blocks, pressure.get("long_prefill_token_threshold", 0))
    engine = sv("engine").LLMEngine(ctx.ckpt, config)
    engine.generate(prompts, sv("config").SamplingParams(temperature=0.0, max_tokens=ctx.cfg.mode.workload.max_tokens,
                                                         ignore_eos=True))
    out = trace_arrays(engine.scheduler.trace, config.max_num_seqs, config.max_blocks_per_seq, config.num_blocks)
    preemptions, evictions = int(out["num_preemptions"]), int(out["num_evictions"])
    if evictions == 0 or (preemptions == 0 and config.max_running > 1):
        raise ValueError(f"the pressure workload of {ctx.cfg.task_name} does not bite: {preemptions} preemptions, "
                         f"{evictions} evictions with num_blocks={config.num_blocks}")
    return {"prompts": pad_rows(prompts, max(map(len, prompts))), "num_blocks": np.array(config.num_blocks, np.int64),
            "long_prefill_token_threshold": np.array(config.long_prefill_token_threshold, np.int64)}, out


def _first_occurrence(row, lo, hi, banned=()):
    """(position, token) of the first token in row[lo:hi] that occurs nowhere before it and is not banned."""
    for p in range(lo, min(hi, len(row))):
        if row[p] not in row[:p] and row[p] not in banned:
            return p, row[p]
    raise ValueError(f"no fresh token in positions {lo}..{hi} of {row}")


def plan_stop_workload(ctx):
    """Requests that finish every way vLLM finishes one, planned from a free run (same seeds, eos ignored):
    0 at eos (the generation config's first id), 1 at its second eos id, 2 at a stop token, 3 at a stop token
    that is also its last allowed token, 4 at max_tokens, 5 as 0 but ignore_eos, 6 aborted after 3 tokens,
    7 at max_model_len (a prompt longer than the chunked budget), 8 aborted after the first step, before
    its first token (still waiting in core mode, mid-prefill in the others)."""
    w, cfg, SP = ctx.cfg.mode.workload, ctx.engine_config, sv("config").SamplingParams
    r, (lo, hi), M = rng_for(f"{ctx.cfg.task_name}/stop"), w.prompt_len, w.max_tokens
    prompts = [[int(x) for x in r.integers(3, ctx.prompt_vocab, int(r.integers(lo, hi + 1)))] for _ in range(7)]
    prompts[5] = prompts[0]
    prompts.append([int(x) for x in r.integers(3, ctx.prompt_vocab, cfg.max_model_len - 3)])
    prompts.append([int(x) for x in r.integers(3, ctx.prompt_vocab, hi)])
    n = len(prompts)
    seeds = np.array([500, 501, 502, 503, 504, 500, 506, 507, 508], np.int64)  # 5 repeats 0: same prompt and draws
    free_run = {"seed": seeds, "stop_token": [-1] * n, "max_tokens": [M] * n, "ignore_eos": [1] * n}
    pre = sv("engine").LLMEngine(ctx.ckpt, cfg).generate(prompts, stop_params(SP, free_run))
    outs = [o.output_token_ids for o in pre]
    others = lambda *own: {t for i, o in enumerate(outs) if i not in own for t in o}  # noqa: E731
    _, eos = _first_occurrence(outs[0], 1, M - 2, others(0, 5))
    _, eos2 = _first_occurrence(outs[1], 1, M - 2, others(1, 5) | {eos})
    _, stop2 = _first_occurrence(outs[2], 2, M - 2, {eos, eos2})
    p3, stop3 = _first_occurrence(outs[3], 2, M - 2, {eos, eos2})
    plan = {"seed": seeds, "stop_token": np.array([-1, -1, stop2, stop3, -1, -1, -1, -1, -1], np.int64),
            "max_tokens": np.array([M, M, M, p3 + 1, 4, M, M, M, M], np.int64),
            "ignore_eos": np.array([0, 0, 0, 0, 0, 1, 0, 0, 0], np.int64),
            "abort_after": np.array([-1, -1, -1, -1, -1, -1, 3, -1, 0], np.int64)}
    return prompts, np.array([eos, eos2], np.int64), plan


def probe_stop_conditions(ctx):
    prompts, eos_ids, plan = plan_stop_workload(ctx)
    engine = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config,
                                    override_generation_config={"eos_token_id": eos_ids.tolist()})
    out = run_stop_workload(engine, prompts, stop_params(sv("config").SamplingParams, plan), plan["abort_after"])
    got = list(zip(out["finish_reason"].tolist(), out["stop_reason"].tolist()))
    want = [(1, -1), (1, int(eos_ids[1])), (1, int(plan["stop_token"][2])), (1, int(plan["stop_token"][3])),
            (2, -1), (2, -1), (3, -1), (2, -1), (3, -1)]
    lens = [int((row >= 0).sum()) for row in out["output_ids"]]
    if (got != want or lens[3] != plan["max_tokens"][3] or lens[4] != 4 or eos_ids[0] not in out["output_ids"][5]
            or lens[8] != 0
            or len(prompts[7]) + lens[7] != ctx.engine_config.max_model_len):
        raise ValueError(f"the stop workload of {ctx.cfg.task_name} misses a stop condition: {got} != {want}")
    return {"prompts": pad_rows(prompts, max(map(len, prompts))), "eos_token_ids": eos_ids, **plan}, out


def probe_sampling_branches(ctx):
    prompts, w = workload(ctx.cfg, ctx.prompt_vocab), ctx.cfg.mode.workload
    out = {}
    for name, params in branch_params(sv("config").SamplingParams, len(prompts), w.max_tokens).items():
        outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(prompts, params)
        out[name] = pad_rows([o.output_token_ids for o in outs], w.max_tokens)
    return {"prompts": pad_rows(prompts, max(map(len, prompts)))}, out


LONG_DECODE_REQUESTS = 24


def probe_long_decode(ctx):
    """Short prompts sharing their first block, served one by one, each to max_model_len (ignore_eos). The
    first also holds a second full block, with which the second prompt starts: by then the first has finished
    and its blocks sit cached, and only a hash chained to the parent's keeps the second from taking KV
    computed at other positions (in every mode, batched or not)."""
    r, bs = rng_for(f"{ctx.cfg.task_name}/long_decode"), ctx.engine_config.block_size
    head, middle = ([int(x) for x in r.integers(3, ctx.prompt_vocab, bs)] for _ in range(2))
    prompts = [head + [int(x) for x in r.integers(3, ctx.prompt_vocab, int(r.integers(2, 2 * bs + 1)))]
               for _ in range(LONG_DECODE_REQUESTS)]
    prompts[0] = head + middle + prompts[0][bs:]
    prompts[1] = middle + prompts[1][bs:]
    engine = sv("engine").LLMEngine(ctx.ckpt, long_decode_config(ctx.engine_config))
    out = run_long_decode(engine, prompts, sv("config").SamplingParams, ctx.engine_config.max_model_len)
    if (out["finish_reason"] != FINISH_CODES["length"]).any():
        raise ValueError(f"the long decode of {ctx.cfg.task_name} did not run every request to max_model_len")
    return {"prompts": pad_rows(prompts, max(map(len, prompts)))}, out


def probe_heldout_logprobs(ctx):
    """Held-out prompt log-probs through the live engine (SamplingParams.prompt_logprobs, chunk by chunk). The
    third prompt starts with the first one's two full blocks: asking for prompt logprobs bypasses the cache."""
    prompts = [_prompt(f"heldout_{i}", ctx.prompt_vocab, L).tolist() for i, L in enumerate(HELDOUT_LENS)]
    head = 2 * ctx.engine_config.block_size
    if head >= min(HELDOUT_LENS[0], HELDOUT_LENS[2]):
        raise ValueError(f"block_size {ctx.engine_config.block_size} too large for the held-out prompts")
    prompts[2][:head] = prompts[0][:head]
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        prompts, sv("config").SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS))
    out = {}
    for i, o in enumerate(outs):
        out[f"prompt_{i}"], out[f"top_{i}"] = prompt_logprob_arrays(o, TOP_LOGPROBS)
    return {f"prompt_{i}": np.array(p, np.int32) for i, p in enumerate(prompts)}, out


def probe_next_token_dists(ctx):
    """The live engine's full next-token distribution at every greedy step (logprobs=-1)."""
    prompts, w = workload(ctx.cfg, ctx.prompt_vocab)[:4], ctx.cfg.mode.workload
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        prompts, sv("config").SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True,
                                             logprobs=-1))
    return ({f"prompt_{i}": np.array(p, np.int32) for i, p in enumerate(prompts)},
            {f"logprobs_{i}": dense_logprobs(o.logprobs, ctx.vocab) for i, o in enumerate(outs)})


PROBES = {
    "layout": probe_layout, "engine_api": probe_engine_api, "param_tree": probe_param_tree,
    "paged_attention": _attention_probe("paged_attention"),
    "paged_attention_window_softcap": _attention_probe("paged_attention_window_softcap", window=3, cap=5.0),
    # the torch source has one attention; the JAX side answers these with its Pallas kernel (grader probes)
    "paged_attention_kernel": _attention_probe("paged_attention_kernel", long=True),
    "paged_attention_kernel_window_softcap": _attention_probe("paged_attention_kernel_window_softcap", window=70,
                                                              cap=5.0, long=True),
    "paged_attention_sinks": _attention_probe("paged_attention_sinks", window=5, sinks=True),
    "paged_attention_kernel_sinks": _attention_probe("paged_attention_kernel_sinks", window=70, long=True,
                                                     sinks=True),
    "rope": probe_rope, "norm": probe_norm, "moe_routing": probe_moe_routing,
    "expert_activation": probe_expert_activation, "mxfp4_dequant": probe_mxfp4_dequant, "moe_block": probe_moe_block,
    **{f"sampler_{w}": _sampler_probe(w) for w in ("penalties", "temperature", "min_p", "top_k_top_p",
                                                   "greedy", "random")},
    "sampler_pipeline": probe_sampler_pipeline, "decoder_layer_paged": probe_decoder_layer_paged,
    **{name: _prefill_probe(name) for name in PROMPT_LENS},
    "decode_logits": probe_teacher_forced, "cache_state": probe_cache_state,
    "greedy_sequences": probe_greedy_sequences, "sampled_sequences": probe_sampled_sequences,
    "engine_invariants": probe_engine_invariants, "schedule_trace": probe_schedule_trace,
    "stop_conditions": probe_stop_conditions, "sampling_branches": probe_sampling_branches,
    "long_decode": probe_long_decode, "heldout_logprobs": probe_heldout_logprobs, "next_token_dists": probe_next_token_dists,
}


def record_task(cfg, dev, console):
    """-> (records, band, end-to-end wall-clock of the L5 workload on the torch engine)."""

    spec, checks = checks_for("serving", None, frozenset(cfg.family.get("features", ())))
    ctx = Ctx(cfg)
    records = run_probes([s for s in spec + checks if s.name != "torch_free"], PROBES, ctx, console)
    return records, None, ctx.wall


PROBES.update(importlib.import_module("recorder.probes.serving_vision").PROBES)  # picked by feature tags
