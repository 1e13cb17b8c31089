"""Workloads that the recorder (torch side) and the grader (a candidate) drive the same way: serving drivers,
the training L4 optimizer variant, the tied twin of a checkpoint.

The recorder plans a workload and records the plan as the check's inputs; both sides then build their own
SamplingParams and step their own engine with these functions, so the two runs differ only in the engine.
Plain Python and numpy: the engine's classes come in as arguments.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from catalog.trace import image_trace_arrays

__all__ = ["SAMPLED", "FINISH_CODES", "TOP_LOGPROBS", "sampled_params", "branch_params", "stop_params", "run_stop_workload",
           "pad_rows", "unpad_rows", "dense_logprobs", "prompt_logprob_arrays", "run_long_decode", "long_decode_config",
           "FIXED_STEPS_VARIANT", "FIXED_STEPS_OPTIONS", "DPO_FIXED_STEPS_OPTIONS", "DATA_VARIANTS", "data_fields", "tied_checkpoint",
           "fixed_step_runs", "TIE_METRICS", "WIDTH_METRICS", "width_dependent_metrics", "rewarded_steps", "dpo_trajectory_outputs", "dpo_eval_outputs",
           "PPO_FIXED_STEPS_OPTIONS", "PPO_TIE_STATS", "PPO_NOISE_STATS", "PPO_MOVED_STATS", "moved_steps", "ppo_stats_outputs", "ppo_fixed_step_runs", "ppo_fixed_step_outputs", "prompt_rows", "prompt_features",
           "ROLLOUT_SAMPLING_OPTIONS", "GAE_OPTIONS", "KL_COEFS", "KL_CONTROLLER_KLS", "layer_positions", "tower_outputs", "collate_outputs",
           "image_prompts", "image_workload_config", "run_image_workload", "step_image_outputs"]

# The L5 sampled workload: every optional stage of the sampler at once.
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.1)
# finish_reason of a RequestOutput as an int (0: never finished, which a complete run does not leave).
FINISH_CODES = {None: 0, "stop": 1, "length": 2, "abort": 3}
TOP_LOGPROBS = 5  # L6 heldout_logprobs: prompt_logprobs=5, as vLLM's parity tests ask for top-5
# Training L4 fixed_steps also runs under these optimizer options: the task's weight decay is 0.0 and its
# schedule cosine, so a decay left at torch.optim.AdamW's 0.01, or a broken linear schedule, would hide there.
# Decay and rate large enough that 0.01 instead of 1.0 shrinks lora_A by ~3% in the 1.5 effective steps
# (the first of three is warmup at lr 0): the tensor measure's sqrt(norm ratio) then falls below 0.999.
FIXED_STEPS_VARIANT = "decayed_linear"
FIXED_STEPS_OPTIONS = {"weight_decay": 1.0, "learning_rate": 2.0e-2, "lr_scheduler_type": "linear"}
# DPO's variant also takes LF's options the task leaves at their defaults: label smoothing and the ftx (SFT) term
DPO_FIXED_STEPS_OPTIONS = {**FIXED_STEPS_OPTIONS, "dpo_label_smoothing": 0.1, "pref_ftx": 0.5}
# PPO's variant: the optimizer options above, TRL's fixed KL controller (adap_kl_ctrl False) at a coefficient the
# task's 0.2 never takes, a (gamma, lam) pair that is not the task's (1.0, 0.95) so neither can hide or be swapped,
# and LF's ppo_whiten_rewards
PPO_FIXED_STEPS_OPTIONS = {**FIXED_STEPS_OPTIONS, "learning_rate": 1.0e-2, "adap_kl_ctrl": False, "init_kl_coef": 0.3, "gamma": 0.9,
                           "lam": 0.8, "ppo_whiten_rewards": True}
# PPO's clip fractions count strict comparisons (a ratio past 1 +- cliprange, a value loss past its clipped twin):
# an fp32 rounding at either edge moves them by a whole token, so L5 leaves them out (L1 and L4 grade them)
PPO_TIE_STATS = ("ppo/policy/clipfrac", "ppo/val/clipfrac")
# The mean of the whitened advantages over an epoch of mini-batches is 0 up to fp32 noise by construction: a
# relative measure would grade the noise, so no level grades it from a step (L1 grades it on random tensors).
PPO_NOISE_STATS = ("ppo/policy/advantages_mean",)
# While warmup holds the learning rate at 0 (the first step) every mini-batch's log-probs equal the old ones:
# the KLs are exactly 0 in torch and fp32 noise in another program, and the policy loss is minus the mini-batch
# means of the whitened advantages, which whitening cancels to ~1e-7 (exactly 0 when the mini-batches hold equal
# token counts): a relative measure would grade the noise, so these are graded at the steps that moved (L4's
# ppo_step0_losses grades the policy loss of a policy that differs from its rollouts).
PPO_MOVED_STATS = ("ppo/policy/approxkl", "ppo/policy/policykl", "ppo/loss/policy")
# L1 rollout_rules: the task's sampling settings and two that reach each warper alone
ROLLOUT_SAMPLING_OPTIONS = {"k_only": {"temperature": 1.3, "top_k": 5, "top_p": 1.0},
                            "p_only": {"temperature": 0.7, "top_k": 0, "top_p": 0.5}}
GAE_OPTIONS = {"task": {}, "g09_l08": {"gamma": 0.9, "lam": 0.8}, "whitened": {"ppo_whiten_rewards": True}}
KL_COEFS = (0.2, 0.05)
KL_CONTROLLER_KLS = (0.5, 6.0, 7.0, 9.0, 30.0)  # below, at, inside and past the +-20% clip around target 6


def ppo_fixed_step_runs(train_steps, args) -> dict[str, tuple]:
    """The L4 PPO fixed-steps runs, {"": the task's args, "decayed_linear.": PPO_FIXED_STEPS_OPTIONS}, each
    train_steps(args) -> (stats, responses, adapter, value head) (each side's own trainer)."""
    from dataclasses import replace
    return {name: train_steps(replace(args, **options))
            for name, options in {"": {}, f"{FIXED_STEPS_VARIANT}.": PPO_FIXED_STEPS_OPTIONS}.items()}


def ppo_fixed_step_outputs(runs: dict, moved: dict) -> tuple[dict, dict, dict]:
    """(stats, rollouts, params) outputs of ppo_fixed_step_runs; moved: {"<run>moved_steps": steps}."""
    stats = {f"{name}{k}": v for name, (s, _, _, _) in runs.items()
             for k, v in ppo_stats_outputs(s, moved[f"{name}moved_steps"]).items()}
    rollouts = {f"{name}s{j}": np.asarray(r, np.int64) for name, (_, rs, _, _) in runs.items() for j, r in enumerate(rs)}
    params = {f"{name}{k}": np.asarray(v, np.float32) for name, (_, _, lora, vh) in runs.items()
              for k, v in {**lora, **vh}.items()}
    return stats, rollouts, params


def moved_steps(step_stats: dict) -> np.ndarray:
    """Indices of the steps whose policy moved within the step (the reference run's approxkl is not 0)."""
    return np.flatnonzero(np.asarray(step_stats["ppo/policy/approxkl"], np.float64) != 0).astype(np.int64)


def ppo_stats_outputs(step_stats: dict, moved, skip=()) -> dict[str, np.ndarray]:
    """Per-step PPO stats as {"<stat name with dots>": f32[steps]}: PPO_MOVED_STATS at the `moved` steps
    (moved_steps of the reference run), without PPO_NOISE_STATS and `skip`."""
    moved = np.asarray(moved, np.int64)
    return {metric_key(k): np.asarray(v, np.float32)[moved] if k in PPO_MOVED_STATS else np.asarray(v, np.float32)
            for k, v in step_stats.items() if k not in skip and k not in PPO_NOISE_STATS}


def prompt_rows(features: list[dict]) -> np.ndarray:
    """Prompt features -> their input_ids as rows padded with -1 (an HDF5 input)."""
    return pad_rows([list(f["input_ids"]) for f in features])


def prompt_features(rows) -> list[dict]:
    """The inverse of prompt_rows: [dict(input_ids, attention_mask)] of unpadded lists."""
    return [{"input_ids": r, "attention_mask": [1] * len(r)} for r in unpad_rows(rows)]


# LF's data options the task leaves off, graded on the same rows by the L1 data checks: the labelled prompts,
# and the last turn labelled alone and given the cutoff budget first
def layer_positions(features, positions) -> np.ndarray:
    """The position ids a layer-level check hands a family: i32[B,T] as given, or (pos:mrope) i32[3,B,T] with
    three different streams (temporal, height, width) as an image span gives them, so that an M-RoPE section
    split wrong inside the layer shows (text alone would give three equal rows and hide it)."""
    positions = np.asarray(positions, np.int32)
    if "pos:mrope" not in features:
        return positions
    return np.stack([positions, positions // 2, positions % 3 + positions // 3]).astype(np.int32)


# the forward's image keywords beside pixel_values, by family: Qwen-VL's grids, Gemma 3's and PaliGemma's token types,
# LLaVA-NeXT's image sizes (a recorded batch with images carries those its family takes)
IMAGE_INPUTS = ("image_grid_thw", "token_type_ids", "image_sizes")


def tower_outputs(encoded, to_numpy) -> dict[str, np.ndarray]:
    """A family's encode_images output as the vision_tower check's arrays: {"embeds" f32[n,D]} and, for a tower with
    DeepStack features, {"deepstack" f32[n,K,D]}, whether the family returns the merged patches alone, a
    (patches, [features]) pair, or its forward keywords {image_embeds, deepstack_embeds}."""
    if isinstance(encoded, dict):
        embeds, deepstack = encoded["image_embeds"], encoded.get("deepstack_embeds")
    elif isinstance(encoded, tuple):
        embeds, deepstack = encoded[0], (np.stack([to_numpy(d) for d in encoded[1]], axis=1) if encoded[1] else None)
    else:
        embeds, deepstack = encoded, None
    out = {"embeds": np.asarray(to_numpy(embeds), np.float32)}
    if deepstack is not None:
        out["deepstack"] = np.asarray(to_numpy(deepstack), np.float32)
    return out


COLLATED = ("input_ids", "attention_mask", "labels", "position_ids")  # what the collate checks compare


def collate_outputs(features, collate, rows: list[dict], to_numpy) -> dict[str, np.ndarray]:
    """The collate checks' outputs: the first four rows collated; with images (data:images) also the first two rows
    that hold none, which LF's collator gives its fake image (the only batch where it shows)."""
    def fields(batch, prefix=""):
        return {prefix + k: np.asarray(to_numpy(batch[k])).astype(np.int64) for k in COLLATED if k in batch}

    out = fields(collate(rows[:4]))
    if "data:images" in features:
        out |= fields(collate([r for r in rows if not r.get("images")][:2]), "imageless.")
    return out


DATA_VARIANTS = {"train_on_prompt": {"train_on_prompt": True}, "mask_history": {"mask_history": True}}


def fixed_step_runs(train_steps, args, variant_options: dict) -> tuple[dict, dict]:
    """The L4 fixed-steps outputs: train_steps(args) -> (losses, final adapter) under the task's args and under
    variant_options, as ({"[variant.]losses": ...}, {"[variant.]<PEFT name>": ...}) (each side's own trainer)."""
    from dataclasses import replace
    runs = {name: train_steps(replace(args, **options))
            for name, options in {"": {}, f"{FIXED_STEPS_VARIANT}.": variant_options}.items()}
    return ({f"{name}losses": np.asarray(losses, np.float32) for name, (losses, _) in runs.items()},
            {f"{name}{k}": np.asarray(v, np.float32) for name, (_, final) in runs.items() for k, v in final.items()})


# DPO's logged accuracy is a step function of each pair's reward margin: where margins are near zero (the first
# steps, and any pair the adapter barely separates) an fp32 rounding flips it, so L5 leaves it out; L4 grades it
# at an adapter whose margins are clear, and L6 from the candidate's logits, banded.
TIE_METRICS = ("rewards/accuracies",)


def metric_key(name: str) -> str:
    """A logged metric's name as an HDF5 dataset name ("rewards/chosen" -> "rewards.chosen")."""
    return name.replace("/", ".")


def rewarded_steps(step_metrics: dict) -> np.ndarray:
    """Indices of the steps whose policy differs from the reference: while warmup holds the adapter at its
    init (lora_B = 0) every reward is exactly 0 in torch, and a relative measure of ~1e-9 against 0 is 0."""
    chosen, rejected = (np.asarray(step_metrics[k], np.float64) for k in ("rewards/chosen", "rewards/rejected"))
    return np.flatnonzero((chosen != 0) | (rejected != 0)).astype(np.int64)


# LF's logits means average every position of the collated rows, padding included. Under a sliding window a
# padded query past the window sees no key, and HF's eager attention then spreads it evenly over every key of
# the batch: its logits depend on the width the collator padded to, which a static-shape port pads otherwise.
# So for sliding-window families the end-to-end runs leave them out (L4 grades them on torch's own batches).
WIDTH_METRICS = ("logits/chosen", "logits/rejected")


def width_dependent_metrics(features) -> tuple[str, ...]:
    return WIDTH_METRICS if "attn:sliding_window" in set(features or ()) else ()


def dpo_trajectory_outputs(step_metrics: dict, steps, skip=()) -> dict[str, np.ndarray]:
    """The graded per-step metrics of an end-to-end DPO run: the rewards at `steps` (rewarded_steps of the
    reference run), log-probs and logits means at every step, no TIE_METRICS and no `skip`."""
    steps = np.asarray(steps, np.int64)
    return {metric_key(k): np.asarray(v, np.float32)[steps] if k.startswith("rewards/") else np.asarray(v, np.float32)
            for k, v in step_metrics.items() if k not in TIE_METRICS and k not in skip}


def dpo_eval_outputs(before: dict, after: dict, skip=()) -> dict[str, np.ndarray]:
    """The graded held-out metrics before and after training: before training the policy is the reference, so
    its rewards are exactly 0 and leave; no TIE_METRICS and no `skip`."""
    return {f"{when}.{metric_key(k)}": np.float32(v) for when, d in (("before", before), ("after", after))
            for k, v in d.items()
            if k not in TIE_METRICS and k not in skip and not (when == "before" and k.startswith("rewards/"))}


def data_fields(processed, field: str, width: int, fill: int) -> dict[str, np.ndarray]:
    """{"<field>": rows under the task's options, "<field>.<variant>": rows under each DATA_VARIANTS entry},
    padded to width. processed(**options) -> the processed examples (each side's own pipeline)."""
    variants = {"": {}, **{f".{k}": v for k, v in DATA_VARIANTS.items()}}
    out = {}
    for suffix, options in variants.items():
        try:
            rows = [list(ex[field])[:width] for ex in processed(**options)]
        except ValueError:  # LF refuses the option for this template (train_on_prompt with efficient_eos)
            if not suffix:
                raise
            out[field + suffix] = np.full((1, width), REFUSED, np.int64)
            continue
        out[field + suffix] = pad_rows(rows, width, fill)
    return out


REFUSED = -2  # a data variant the template refuses: both sides must refuse it too


def pad_rows(rows, width: int | None = None, fill: int = -1) -> np.ndarray:
    width = max(1, max(map(len, rows), default=1)) if width is None else width
    out = np.full((len(rows), width), fill, np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def unpad_rows(rows) -> list[list[int]]:
    return [[int(x) for x in row if x >= 0] for row in np.asarray(rows)]


def sampled_params(SamplingParams, num: int, max_tokens: int) -> list:
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=100 + i, **SAMPLED) for i in range(num)]


def branch_params(SamplingParams, num: int, max_tokens: int) -> dict[str, list]:
    """Batches that take the sampler's other paths: top-p alone (seeded), min-p alone (unseeded: the
    engine-wide noise stream, which depends on the batch and the step)."""
    return {"top_p_only": [SamplingParams(temperature=1.0, top_p=0.7, seed=300 + i, max_tokens=max_tokens,
                                          ignore_eos=True) for i in range(num)],
            "min_p_only": [SamplingParams(temperature=1.3, min_p=0.1, max_tokens=max_tokens, ignore_eos=True)
                           for _ in range(num)]}


def stop_params(SamplingParams, plan) -> list:
    """plan: i64 arrays over requests: seed, stop_token (-1 none), max_tokens, ignore_eos (0/1). Seeded sampling,
    not greedy: a tiny random model's greedy run repeats one token, which leaves no distinct stop tokens."""
    return [SamplingParams(temperature=1.0, seed=int(seed), max_tokens=int(m), ignore_eos=bool(ie),
                           stop_token_ids=() if s < 0 else (int(s),))
            for seed, s, m, ie in zip(plan["seed"], plan["stop_token"], plan["max_tokens"], plan["ignore_eos"])]


def run_stop_workload(engine, prompts: Sequence[Sequence[int]], params: Sequence, abort_after) -> dict:
    """Requests "0".."R-1" stepped to completion; request i is aborted once it holds abort_after[i] output
    tokens (-1: never). -> the outputs each request ended with, its finish reason and stop reason (as ints),
    the engine's unfinished-request count after every step (an abort must leave the scheduler at once) and
    the free blocks once everything is done (an abort must give its blocks back). The last count comes
    after aborting a finished and an unknown id and one idle step."""
    ids = [str(i) for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, list(prompt), p)
    last: dict[str, list[int]] = {rid: [] for rid in ids}
    reason = {rid: 0 for rid in ids}
    stop = {rid: -1 for rid in ids}
    unfinished = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            last[o.request_id] = list(o.output_token_ids)
            if o.finished:
                reason[o.request_id] = FINISH_CODES[o.finish_reason]
                stop[o.request_id] = -1 if o.stop_reason is None else int(o.stop_reason)
        for i, rid in enumerate(ids):
            if 0 <= abort_after[i] <= len(last[rid]) and reason[rid] == 0:
                engine.abort_request([rid])
                reason[rid] = FINISH_CODES["abort"]
        unfinished.append(engine.get_num_unfinished_requests())
    # Everything is done: aborting a finished and an unknown id is a no-op, and a step with nothing to run
    # returns no output (vLLM's engine loop calls step() on an idle engine all the time).
    engine.abort_request([ids[0], "no-such-request"])
    if engine.step():
        raise RuntimeError("an idle engine step returned outputs")
    unfinished.append(engine.get_num_unfinished_requests())
    return {"output_ids": pad_rows([last[rid] for rid in ids]),
            "finish_reason": np.array([reason[rid] for rid in ids], np.int64),
            "stop_reason": np.array([stop[rid] for rid in ids], np.int64),
            "unfinished_per_step": np.array(unfinished, np.int64),
            "free_blocks_after": np.array(engine.stats()["num_free_blocks"], np.int64)}


def long_decode_config(engine_config):
    """The mode's engine with prefix caching on (vLLM v1's default), so requests served one after another can
    hit the blocks earlier ones cached: in every mode, whatever the mode's own default."""
    return replace(engine_config, enable_prefix_caching=True)


def run_long_decode(engine, prompts: Sequence[Sequence[int]], SamplingParams, max_model_len: int) -> dict:
    """Requests served one after another on one engine (an online client waiting for each answer), each
    decoding greedily to max_model_len: -> {"output_ids": i64[N, longest] padded with -1, "finish_reason"}.
    Hundreds of engine steps: the L5 budget binds on an engine that dispatches op by op (no jit)."""
    rows, reasons = [], []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_model_len - len(prompt), ignore_eos=True)
        (out,) = engine.generate([list(prompt)], params)
        rows.append(out.output_token_ids)
        reasons.append(FINISH_CODES[out.finish_reason])
    return {"output_ids": pad_rows(rows, max(map(len, rows))), "finish_reason": np.array(reasons, np.int64)}


def dense_logprobs(logprobs, vocab: int) -> np.ndarray:
    """A RequestOutput's logprobs=-1 dicts -> f32[N, vocab] (a token missing from a dict is -inf)."""
    out = np.full((len(logprobs), vocab), -np.inf, np.float32)
    for j, entry in enumerate(logprobs):
        for token, lp in entry.items():
            out[j, token] = lp.logprob
    return out


def prompt_logprob_arrays(output, top: int) -> tuple[np.ndarray, np.ndarray]:
    """A RequestOutput's prompt_logprobs -> (f32[n-1] log-prob of each prompt token after the first,
    f32[n-1, top] the `top` largest log-probs at each position, descending: blind to which of tied ids)."""
    entries = output.prompt_logprobs[1:]
    chosen = np.array([e[t].logprob for e, t in zip(entries, output.prompt_token_ids[1:])], np.float32)
    best = np.array([sorted((lp.logprob for lp in e.values()), reverse=True)[:top] for e in entries], np.float32)
    return chosen, best


def _without_tensor(src: Path, dst: Path, name: str) -> None:
    """Copy safetensors file `src` to `dst` less tensor `name`, byte ranges moved as they are (any dtype)."""
    import json
    import struct

    with open(src, "rb") as f, open(dst, "wb") as g:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        kept = sorted((k for k in header if k not in ("__metadata__", name)), key=lambda k: header[k]["data_offsets"])
        out, pos = ({"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}), 0
        for k in kept:
            begin, end = header[k]["data_offsets"]
            out[k] = {**header[k], "data_offsets": [pos, pos + end - begin]}
            pos += end - begin
        text = json.dumps(out, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        g.write(struct.pack("<Q", len(text)) + text)
        for k in kept:
            begin, end = header[k]["data_offsets"]
            f.seek(8 + n + begin)
            g.write(f.read(end - begin))


LLAVA_LAYOUTS = ("gemma3", "paligemma", "llava_next", "internvl")  # model types whose head is language_model.lm_head


def tied_checkpoint(ckpt, out) -> Path:
    """`ckpt` as a tied release stores it (Llama 3.2 1B/3B): tie_word_embeddings set, no lm_head.weight,
    so the embedding doubles as the output head. A sharded `ckpt` stays sharded, its index without the head."""
    import json

    ckpt, out = Path(ckpt), Path(out)
    config = json.loads((ckpt / "config.json").read_text())
    if "thinker_config" in config:  # Qwen2.5-Omni: the thinker holds the tie and its head
        config, head = {**config, "thinker_config": {**config["thinker_config"], "tie_word_embeddings": True}}, \
            "thinker.lm_head.weight"
    else:  # a LLaVA-layout release (the fixed-size towers) stores its head under language_model.
        config = {**config, "tie_word_embeddings": True}
        head = "language_model.lm_head.weight" if config.get("model_type") in LLAVA_LAYOUTS else "lm_head.weight"
    (out / "config.json").write_text(json.dumps(config))
    index = None if (ckpt / "model.safetensors").is_file() else \
        json.loads((ckpt / "model.safetensors.index.json").read_text())
    for name in ["model.safetensors"] if index is None else sorted(set(index["weight_map"].values())):
        _without_tensor(ckpt / name, out / name, head)
    if index is not None:
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != head}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


# ---- images through the live engine (serving, vision:qwen) ------------------------------------------------------

def image_prompts(prompts, image_ids, images) -> list:
    """Token rows (one image token per image) and each row's image indices (-1 padded) into `images` -> vLLM
    tokens prompts: a row without images stays a plain token list."""
    out = []
    for row, ids in zip(unpad_rows(prompts), np.asarray(image_ids)):
        chosen = [images[int(i)] for i in ids if i >= 0]
        out.append({"prompt_token_ids": row, "multi_modal_data": {"image": chosen}} if chosen else row)
    return out


def image_workload_config(engine_config, vision):
    """The mode's engine with prefix caching and the trace on, the task's encoder compute budget and encoder cache
    (an image must wait for the one before it; an unreferenced output is evicted) and a KV pool that preempts."""
    return replace(engine_config, enable_prefix_caching=True, record_trace=True, num_blocks=int(vision["num_blocks"]),
                   max_num_encoder_input_tokens=int(vision["encoder_budget"]),
                   encoder_cache_size=int(vision["encoder_cache"]))


def run_image_workload(engine, prompts, SamplingParams, max_tokens: int, image_index: dict) -> dict:
    """Greedy outputs of image prompts, the step trace with the images encoded and evicted (catalog/trace.py),
    the prefix-cache hits and the blocks back in the pool."""
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    cfg, stats = engine.config, engine.stats()
    return {"output_ids": pad_rows([o.output_token_ids for o in outs], max_tokens),
            **image_trace_arrays(engine.scheduler.trace, cfg.max_num_seqs, cfg.max_blocks_per_seq, cfg.num_blocks,
                                 image_index),
            "prefix_hit_blocks": np.array(stats["num_prefix_hit_blocks"], np.int64),
            "free_blocks_after": np.array(stats["num_free_blocks"], np.int64)}


def step_image_outputs(case, request_cls, batch_cls, input_batch, image_hash, imgs) -> dict:
    """Either side's input_batch on the case: the step's M-RoPE positions and its image-row slices (request, token
    index, image id, first and last row)."""
    n_req = len(case["query_start_loc"]) - 1
    requests, tables, index = {}, {}, {image_hash(im): i for i, im in enumerate(imgs)}
    for k in range(n_req):
        tokens, num_prompt = [int(x) for x in case[f"tokens_{k}"]], int(case[f"num_prompt_{k}"])
        placeholders = tuple((int(o), int(n), image_hash(imgs[int(i)])) for o, n, i in
                             zip(case[f"offsets_{k}"], case[f"lengths_{k}"], case[f"image_ids_{k}"]))
        req = request_cls(str(k), tokens[:num_prompt], mm_placeholders=placeholders)
        req.output_token_ids = tokens[num_prompt:]
        requests[str(k)] = req
        tables[str(k)] = ([[int(x) for x in row] for row in case[f"table_{k}"]], int(case[f"delta_{k}"]))
    qsl = [int(x) for x in case["query_start_loc"]]
    positions = [int(x) for x in case["positions"]]
    input_ids = [requests[str(k)].all_token_ids[positions[i]] for k in range(n_req) for i in range(qsl[k], qsl[k + 1])]
    T = len(positions)
    batch = batch_cls(req_ids=[str(k) for k in range(n_req)], input_ids=input_ids + [0] * (T - len(input_ids)),
                      positions=positions, slot_mapping=[-1] * T, block_tables=[[0]] * n_req, seq_lens=[0] * n_req,
                      query_start_loc=qsl, logits_indices=[q - 1 for q in qsl[1:]], num_seqs=n_req,
                      num_tokens=qsl[-1], padded_num_tokens=T)
    slices = [[int(s.request_id), s.token_index, index[s.mm_hash], s.start, s.end]
              for s in input_batch.multimodal_slices(batch, requests)]
    return {"positions": np.array(input_batch.mrope_positions(batch, tables), np.int64),
            "slices": np.array(slices, np.int64).reshape(-1, 5)}
